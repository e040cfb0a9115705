"""The runtime's two modes as objects: each placement and each sampler offers every method of its
protocol, as a method (never hidden behind an attribute of the same name that an instance sets), and
a runtime holds the ones it was started with."""

from __future__ import annotations

import ast
import inspect

import pytest

from sess.engine.runtime.distributed.ranks import Ranks
from sess.engine.runtime.placement import Placement, SingleProcess
from sess.engine.runtime.runtime import Runtime
from sess.engine.runtime.samplers import BuiltinSampler, Sampler
from sess.engine.runtime.vllm.sampler import VllmSampler


def _methods(protocol: type) -> set[str]:
    return {
        name
        for name, value in vars(protocol).items()
        if not name.startswith("_") and (inspect.isfunction(value) or isinstance(value, property))
    }


def _set_on_self(cls: type) -> set[str]:
    """Attributes ``cls``'s own code assigns on ``self``."""
    tree = ast.parse(inspect.getsource(cls))
    return {
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and isinstance(node.ctx, ast.Store)
        and isinstance(node.value, ast.Name)
        and node.value.id == "self"
    }


@pytest.mark.parametrize(
    ("protocol", "cls", "some"),
    [
        (Placement, SingleProcess, {"load_host", "plan", "adapter_gathered", "spread_decoding"}),
        (Placement, Ranks, {"load_host", "plan", "adapter_gathered", "spread_decoding"}),
        (Sampler, BuiltinSampler, {"check_session", "job", "submit", "forget"}),
        (Sampler, VllmSampler, {"check_session", "job", "submit", "forget"}),
    ],
)
def test_every_mode_offers_each_method_of_its_protocol(protocol, cls, some):
    methods = _methods(protocol)
    assert some <= methods
    calls = methods - {"leader"}  # a property
    assert sorted(name for name in calls if not callable(getattr(cls, name, None))) == []
    assert isinstance(getattr(cls, "leader", property()), property)
    assert sorted(methods & _set_on_self(cls)) == []  # an instance's attribute would hide the method
    for name in calls:  # the same parameters, by name, as the protocol's
        want = list(inspect.signature(getattr(protocol, name)).parameters)
        assert list(inspect.signature(getattr(cls, name)).parameters) == want, name


def test_a_runtime_holds_the_modes_it_was_started_with(sess_home):
    plain = Runtime(sess_home)
    assert isinstance(plain.placement, SingleProcess) and isinstance(plain.sampler, BuiltinSampler)
    assert plain.placement.leader and plain.placement.world == 1
    sampler = VllmSampler("/no/such/python", sess_home, max_lora_rank=8)  # starts no worker yet
    assert Runtime(sess_home, sampler=sampler).sampler is sampler
