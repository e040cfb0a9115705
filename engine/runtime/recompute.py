"""Activations autograd would keep that the backward pass makes again from what it keeps anyway.

Of the ~10,200 values a smollm2 decoder layer keeps per position for the backward pass, 4,224 are
cheap to make again from tensors that autograd keeps in any case:

- each RMSNorm's output, kept by the LoRA A matmuls it feeds (the norm keeps its input and the
  reciprocal root for its own backward pass): 2 x 576;
- the MLP's ``act_fn(gate)``, kept by the product with ``up`` (the activation keeps ``gate``, the
  product keeps ``up``): 1,536;
- that product ``act_fn(gate) * up``, kept by the down projection's LoRA A: 1,536.

Inside :func:`recomputing`, the norm and MLP modules of a model prepared with :func:`prepare`
record, through forward hooks on them and the MLP's parts, how each of those outputs was made (:class:`Recipe`), and a saved-tensor pack hook stores a
tensor that is one of them as its recipe instead. The backward pass unpacks the recipe by running
the same modules' code on the same inputs (once per recipe, however many nodes read it), so every
value, and so every gradient, has the same bits as without it. The activation probe of
:mod:`sess.engine.runtime.memory.training_budget` prices a position with the same hook, so the budget holds ~1.7x the positions
it held without it.

Only what the inputs' dtype allows is recorded: a norm in bf16 converts its input to fp32 first, so
its recipe would keep the bf16 input alive beside what autograd keeps: norms are recorded in fp32
only. Checkpointed micro-batches do without (activation checkpointing keeps less still).
"""

from __future__ import annotations

import contextlib
import functools
import threading
import weakref
from collections.abc import Callable, Iterator
from types import SimpleNamespace

import torch

from sess.engine.libraries import torch_internals

_NORMS = ("LlamaRMSNorm", "Qwen3RMSNorm", "Qwen2RMSNorm", "MistralRMSNorm")
_MLPS = ("LlamaMLP", "Qwen3MLP", "Qwen2MLP", "MistralMLP")


class Recipe:
    """How to make one output again: ``make()`` without gradients, at most once."""

    __slots__ = ("make", "value")

    def __init__(self, make: Callable[[], torch.Tensor]):
        self.make: Callable[[], torch.Tensor] | None = make
        self.value: torch.Tensor | None = None

    def __call__(self) -> torch.Tensor:
        if self.value is None:
            with torch.no_grad():
                self.value = self.make()
            self.make = None  # its inputs are no longer needed here
        return self.value


class _Saved:
    """What the graph keeps for a recorded output: its recipe and the layout of the view saved."""

    __slots__ = ("recipe", "size", "stride", "offset")

    def __init__(self, recipe: Recipe, tensor: torch.Tensor):
        self.recipe, self.size, self.stride, self.offset = (
            recipe,
            tensor.size(),
            tensor.stride(),
            tensor.storage_offset(),
        )


class Recorded:
    """The outputs recorded during one forward pass: storage address -> (the output, kept weakly;
    its version when recorded; its recipe)."""

    def __init__(self):
        self.outputs: dict[int, tuple[weakref.ref, int, Recipe]] = {}

    def record(self, output: torch.Tensor, recipe: Recipe) -> None:
        # only a tensor that is its whole storage: any view of that storage is then a view of it
        if output.storage_offset() or not output.is_contiguous() or output.numel() == 0:
            return
        self.outputs[output.untyped_storage().data_ptr()] = (
            weakref.ref(output),
            torch_internals.version_of(output),
            recipe,
        )

    def pack(self, tensor: torch.Tensor) -> torch.Tensor | _Saved:
        entry = self.outputs.get(tensor.untyped_storage().data_ptr())
        if entry is None:
            return tensor
        output, version, recipe = entry
        # a dead output's memory may hold another tensor now; a changed one no longer matches its recipe
        if output() is None or torch_internals.version_of(tensor) != version:
            return tensor
        return _Saved(recipe, tensor)


def unpack(saved: torch.Tensor | _Saved) -> torch.Tensor:
    if type(saved) is _Saved:
        return saved.recipe().as_strided(saved.size, saved.stride, saved.offset)
    return saved


_state = threading.local()


def _recorded() -> Recorded | None:
    recorded = getattr(_state, "recorded", None)
    return recorded if recorded is not None and torch.is_grad_enabled() else None


@contextlib.contextmanager
def recording() -> Iterator[Recorded]:
    """Prepared modules record their outputs' recipes inside this block (on this thread); the
    caller packs saved tensors with :meth:`Recorded.pack` (:func:`recomputing` does both)."""
    before = getattr(_state, "recorded", None)
    _state.recorded = recorded = Recorded()
    try:
        yield recorded
    finally:
        _state.recorded = before
        recorded.outputs.clear()


@contextlib.contextmanager
def recomputing(on: bool = True) -> Iterator[None]:
    """A forward pass whose graph keeps recipes for the outputs listed above (``on``)."""
    if not on:
        yield
        return
    with recording() as recorded, torch.autograd.graph.saved_tensors_hooks(recorded.pack, unpack):
        yield


def prepare(model: torch.nn.Module) -> None:
    """Let ``model``'s RMSNorm and gated-MLP modules record recipes, through forward hooks (once per
    module; outside :func:`recording` the hooks return at once and the modules run as they are)."""
    for module in model.modules():
        if module in _prepared:
            continue
        kind = type(module).__name__
        if kind in _NORMS:
            module.register_forward_hook(_norm_recorded)
        elif kind in _MLPS and all(hasattr(module, n) for n in _MLP_PARTS):
            module.register_forward_pre_hook(_mlp_starts)
            module.register_forward_hook(_mlp_ends)
        else:
            continue
        _prepared.add(module)


_prepared: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()  # modules given their hooks
_MLP_PARTS = ("gate_proj", "up_proj", "down_proj", "act_fn")


def _norm_recorded(norm: torch.nn.Module, args: tuple, output: torch.Tensor) -> None:
    recorded = _recorded()
    if recorded is None or not args or args[0].dtype != torch.float32:
        return
    hidden = args[0]
    # the module's own code on a copy of its weight: a sharded model's weight may be released by then
    shim = SimpleNamespace(weight=norm.weight.detach().clone(), variance_epsilon=norm.variance_epsilon)
    recorded.record(output, Recipe(lambda: type(norm).forward(shim, hidden)))


class _MlpCall:
    """One running ``down_proj(act_fn(gate_proj(x)) * up_proj(x))`` (the model's own forward) on
    this thread: the recipe of its activation once ``act_fn`` returned, then ``up_proj``'s output,
    so ``down_proj``'s input, their product, is recorded before anything saves it."""

    __slots__ = ("mlp", "act", "up")

    def __init__(self, mlp: torch.nn.Module):
        self.mlp = mlp
        self.act: Recipe | None = None
        self.up: torch.Tensor | None = None


# the parts' hooks, registered on the parts the MLP holds when it first runs recording (peft wraps
# its projections in LoRA layers after :func:`prepare`); a hook acts only for its MLP's current part
_hooked_parts: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()


def _mlp_starts(mlp: torch.nn.Module, args: tuple) -> None:
    _state.mlp = None
    if _recorded() is None:
        return
    for name, hook in (("act_fn", _act_done), ("up_proj", _up_done)):
        part = getattr(mlp, name)
        if isinstance(part, torch.nn.Module) and part not in _hooked_parts:
            part.register_forward_hook(functools.partial(hook, name))
            _hooked_parts.add(part)
    down = mlp.down_proj
    if down not in _hooked_parts:
        down.register_forward_pre_hook(_down_starts)
        _hooked_parts.add(down)
    _state.mlp = _MlpCall(mlp)


def _mlp_ends(mlp: torch.nn.Module, args: tuple, output: torch.Tensor) -> None:
    _state.mlp = None


def _call_of(part: torch.nn.Module, name: str) -> _MlpCall | None:
    """The running MLP call ``part`` is the current ``name`` of (None: another module's use of it)."""
    call = getattr(_state, "mlp", None)
    if call is None or getattr(call.mlp, name) is not part or _recorded() is None:
        return None
    return call


def _act_done(name: str, act_fn: torch.nn.Module, args: tuple, act: torch.Tensor) -> None:
    call = _call_of(act_fn, name)
    if call is None or call.act is not None:
        return
    gate = args[0]
    call.act = Recipe(lambda: act_fn(gate))
    _recorded().record(act, call.act)  # before the product saves it


def _up_done(name: str, up_proj: torch.nn.Module, args: tuple, up: torch.Tensor) -> None:
    call = _call_of(up_proj, name)
    if call is not None and call.act is not None and call.up is None:
        call.up = up


def _down_starts(down_proj: torch.nn.Module, args: tuple) -> None:
    call = _call_of(down_proj, "down_proj")
    if call is None or call.act is None or call.up is None:
        return
    act_recipe, up = call.act, call.up
    _state.mlp = None  # one product per call
    _recorded().record(args[0], Recipe(lambda: act_recipe() * up))
