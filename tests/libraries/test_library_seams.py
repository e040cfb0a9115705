"""The seams to library internals (sess.engine.libraries): the installed torch, transformers and
peft are the versions the seams were checked on, and each seam gives, on them, what the public
computation it stands in for gives."""

from __future__ import annotations

import functools
from importlib.metadata import version

import pytest
import torch

from sess.engine.libraries import CHECKED, torch_internals, transformers_internals


@pytest.mark.parametrize("library", sorted(CHECKED))
def test_the_installed_libraries_are_the_versions_the_seams_were_checked_on(library):
    installed = version(library).split("+")[0]  # torch's local tag (+cpu, +cu128) is a build, not a version
    assert installed == CHECKED[library], (
        f"{library} {installed} is installed; the seams of sess.engine.libraries were checked on "
        f"{CHECKED[library]}: check each function there on {installed}, then update CHECKED"
    )


def test_a_tensor_version_counts_in_place_changes():
    t = torch.zeros(3)
    before = torch_internals.version_of(t)
    t.add_(1)
    assert torch_internals.version_of(t) == before + 1
    torch.autograd.graph.increment_version(t)
    assert torch_internals.version_of(t) == before + 2


def test_a_module_s_own_parameters_and_children_are_the_public_ones():
    model = torch.nn.Sequential(torch.nn.Linear(3, 2))
    model.add_module("heads", torch.nn.ModuleDict({"a": torch.nn.Linear(2, 2)}))
    weight = model[0].weight
    assert torch_internals.parameter_versions([model[0]], "weight") == [(id(weight), weight._version)]
    with torch.no_grad():
        weight.add_(1)
    assert torch_internals.parameter_versions([model[0]], "weight")[0][1] == weight._version > 0
    assert torch_internals.own_child(model, "heads") is model.heads
    assert torch_internals.own_child(model.heads, "a") is model.heads["a"]
    assert torch_internals.own_child(model.heads, "b") is None


def test_the_log_softmax_backward_is_autograd_s_to_the_bit():
    logits = torch.randn(5, 33, generator=torch.Generator().manual_seed(0), requires_grad=True)
    grad = torch.randn(5, 33, generator=torch.Generator().manual_seed(1))
    output = logits.log_softmax(-1)
    (expected,) = torch.autograd.grad(output, logits, grad)
    assert torch.equal(torch_internals.log_softmax_backward(grad, output.detach(), -1), expected)


def test_onednn_s_prepacked_linear_is_f_linear():
    if not torch.backends.mkldnn.is_available():
        pytest.skip("this torch build has no oneDNN")
    weight = torch.randn(24, 16, generator=torch.Generator().manual_seed(0))
    x = torch.randn(5, 16, generator=torch.Generator().manual_seed(1))
    packed = torch_internals.onednn_pack_linear_weight(weight, 64)
    out = torch_internals.onednn_linear()(x, packed, None, "none", [], "")
    torch.testing.assert_close(out, torch.nn.functional.linear(x, weight), rtol=1e-5, atol=1e-5)
    assert torch_internals.onednn_nbytes(packed) >= weight.numel() * 4


def test_fsdp_s_forward_order_is_forgotten(tmp_path):
    """On one gloo rank: FSDP2 records the forward passes through a unit; the seam empties that."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
        fully_shard(model[0])
        fully_shard(model)
        model(torch.randn(2, 4))
        recorded = [len(g._post_forward_indices) for g in model[0]._get_fsdp_state()._fsdp_param_groups]
        assert sum(recorded) > 0
        torch_internals.fsdp_forget_forward_order(model[0])
        for group in model[0]._get_fsdp_state()._fsdp_param_groups:
            assert group._post_forward_indices == []
            assert not getattr(group.comm_ctx, "post_forward_order", [])
    finally:
        dist.destroy_process_group()


def test_a_layer_s_checkpointing_switch_is_the_one_transformers_reads():
    """The switch set through the seam makes the layer checkpoint (its forward runs again in the
    backward pass) and is restored as it was, leaving no function of its own on the instance."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.modeling_layers import GradientCheckpointingLayer

    config = LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2
    )
    model = LlamaForCausalLM(config).eval()
    (layer,) = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    assert transformers_internals.layer_checkpointing(layer) == (False, None)
    calls = []
    layer.register_forward_pre_hook(lambda *_: calls.append(1))

    def checkpointed(*args, **kwargs):
        calls.append("checkpoint")
        return torch.utils.checkpoint.checkpoint(*args, use_reentrant=False, **kwargs)

    transformers_internals.set_layer_checkpointing(layer, True, checkpointed)
    layer.training = True
    model(input_ids=torch.tensor([[1, 2, 3]]), use_cache=False).logits.sum().backward()
    assert "checkpoint" in calls
    transformers_internals.set_layer_checkpointing(layer, False, None)
    layer.training = False
    assert transformers_internals.layer_checkpointing(layer) == (False, None)
    assert "_gradient_checkpointing_func" not in vars(layer)
    func = functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=False)
    transformers_internals.set_layer_checkpointing(layer, True, func)
    assert transformers_internals.layer_checkpointing(layer) == (True, func)
