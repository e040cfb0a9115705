"""The memory budget of a training op: micro-batch sizes, activation checkpointing, and refusals.

A ``forward_backward`` holds its micro-batch's activations until the backward pass has used them,
and beside them one output-layer chunk's logits (:mod:`.output_layer`). The engine's memory budget
(``--memory-budget``, :func:`default_budget`) bounds the two together: a chunk's logits take at
most a quarter of it (:func:`.output_layer.activation_budget`), and micro-batches hold at most as
many positions as fit in the rest. A micro-batch that cannot be made small enough (one datum
longer than the budget allows) runs with activation checkpointing, which keeps only each decoder
layer's input and recomputes the layer in the backward pass (a third more compute for that
micro-batch), within the engine's memory ceiling (the budget given, or by default a share of the
machine's available memory: :func:`default_ceiling`). A datum too long even then is refused before
anything runs, with the limit.

What a position costs is measured, not guessed (:func:`measure_cost`): once per base model, a
forward pass of :data:`PROBE_TOKENS` tokens with the session's adapter counts the bytes autograd
saves for the backward pass (parameters excluded), with the recipes of :mod:`.recompute` as
training keeps them, without them (a layer running), and checkpointed, and a small shared-prefix
group prices what each RL group member's copy of its prompt's keys and values keeps.

On CPU the sampler keeps prepacked copies of the base weights where all of them fit in the budget
when one is given, else in a share of the memory the machine has free (:func:`default_copy_budget`;
:meth:`.LlamaDecoder.packs`).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint

from sess.engine.libraries import transformers_internals
from sess.engine.runtime.recompute import recording
from sess.engine.runtime.recompute import unpack as recompute_unpack

# bytes of activations and output-layer logits on CPU. On smollm2-135m a position keeps ~0.7 MB
# (~0.1 MB checkpointed), so 384 MiB gives a micro-batch ~400 positions beside a 96 MiB logits
# chunk: benchmarks/train.py's 8 x 128 batch runs in 3 micro-batches, near plain PEFT's speed, where
# smaller budgets cost speed and larger ones memory (benchmarks/README.md has the figures).
CPU_BUDGET = 384 << 20
CUDA_SHARE = 0.5  # of the device's free memory when the first training op runs
PROBE_TOKENS = 128
UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "m": 1 << 20, "mb": 1 << 20, "g": 1 << 30, "gb": 1 << 30}


def parse_bytes(text: str) -> int:
    """``"1.5G"``, ``"800M"``, ``"2GB"`` or a plain byte count, as bytes."""
    value = text.strip().lower()
    number = value.rstrip("bgkm")
    unit = value[len(number) :]
    try:
        amount = float(number)
    except ValueError:
        raise ValueError(f"expected a size such as 800M or 2G, got {text!r}") from None
    if unit not in UNITS or amount <= 0:
        raise ValueError(f"expected a positive size such as 800M or 2G, got {text!r}")
    return int(amount * UNITS[unit])


def format_bytes(count: float) -> str:
    """A size in the units :func:`parse_bytes` reads (``G``, ``M``, ``K``: powers of 1024), large
    enough a unit to show it: ``"2.50 GB"``, ``"3.00 MB"``, ``"5 KB"``."""
    for unit, name in ((1 << 30, "GB"), (1 << 20, "MB")):
        if count >= unit:
            return f"{count / unit:.2f} {name}"
    return f"{count / 1024:.0f} KB"


def default_budget(device: str) -> int:
    """The budget when none is given: :data:`CPU_BUDGET` on CPU; on CUDA a share of the memory
    free once the model is loaded."""
    if device.startswith("cuda"):
        free, _ = torch.cuda.mem_get_info(torch.device(device))
        return int(free * CUDA_SHARE)
    return CPU_BUDGET


COPY_SHARE = 0.25  # of the memory available when the engine first samples, for the sampler's copies
CEILING_SHARE = 0.25  # of the memory available when the first training op runs, for one long datum


def available_memory() -> int | None:
    """Bytes the machine has available now (``MemAvailable``); None without /proc (not Linux)."""
    try:
        with open("/proc/meminfo") as meminfo:
            fields = dict(line.split(":", 1) for line in meminfo)
        return int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None


def default_copy_budget(device: str) -> int:
    """Bytes the sampler's prepacked weight copies may take when no budget is given: a quarter of
    the memory the machine has available (``MemAvailable``), so a machine with room samples at the
    copies' speed (a decode step ~1.2-1.4x faster on smollm2) and a small one keeps one copy of the
    model; the training budget is :func:`default_budget` either way. The copies are CPU-only."""
    if device.startswith("cuda"):
        return default_budget(device)
    available = available_memory()
    return CPU_BUDGET if available is None else max(CPU_BUDGET, int(available * COPY_SHARE))


def default_ceiling(device: str) -> int:
    """The most a training op may hold when no budget is given: on CPU, a share of the memory the
    machine has available (:data:`CEILING_SHARE`, never less than :data:`CPU_BUDGET`), on CUDA the
    budget itself. Micro-batches are still planned in :func:`default_budget` (on smollm2, the
    speed of a short batch's micro-batches); the ceiling decides whether a datum too long for that
    runs checkpointed or is refused, so a model's whole window trains where the memory is there
    (on a 24 GiB machine, ~5 GB: smollm2's 8,192 tokens checkpointed need ~0.9 GB)."""
    if device.startswith("cuda"):
        return default_budget(device)
    available = available_memory()
    return CPU_BUDGET if available is None else max(CPU_BUDGET, int(available * CEILING_SHARE))


@dataclass(frozen=True)
class ActivationCost:
    """Bytes a training forward keeps per position: ``plain`` without checkpointing (with the
    recipes of :mod:`.recompute`), ``checkpointed`` with it (the layers' inputs, plus one layer's
    activations while that layer is recomputed)."""

    plain: float
    checkpointed: float
    repeated: float = 0.0  # a group member's copy of one shared-prefix position (its keys and values)
    layer: float = 0.0  # one layer's activations, all kept: a layer running (or recomputed) holds them

    def fits(self, positions: int, budget: int) -> bool:
        return positions * self.plain <= budget

    def fits_checkpointed(self, positions: int, budget: int) -> bool:
        return positions * self.checkpointed <= budget


def saved_bytes(
    run, model: torch.nn.Module, device: torch.device, *, backward: bool = False, recompute: bool = False
) -> int:
    """Bytes of the distinct tensors autograd saves while ``run()`` builds its graph: activations
    only, not weights (neither ``model``'s parameters nor anything that takes no gradient, such as
    the frozen weights a sharded model gathers for the pass). With ``recompute``, as training's
    :func:`.recompute.recomputing` saves them: an output kept as its recipe costs nothing.

    Unless the graph is for a ``backward`` pass, the graph itself saves nothing: a pack hook that
    returns the tensor ties an output tensor and the graph node saving it in a cycle that Python's
    garbage collector cannot see (it runs through C++), so a graph never run backward was never
    freed (the probes of :func:`measure_cost` held 348 MiB that way on smollm2 for the engine's
    life). The saved tensors are held here instead, while ``run()`` builds the graph, so that, as in
    training, none is freed and its memory reused by the next (which would count twice)."""
    weights = {_data_ptr(p) for p in model.parameters()}
    seen: dict[int, int] = {}
    held: list[torch.Tensor] = []

    def pack(tensor: torch.Tensor):
        if recorded is not None:
            tensor = recorded.pack(tensor)
        if isinstance(tensor, torch.Tensor) and tensor.requires_grad and tensor.device == device:
            storage = tensor.untyped_storage()
            if storage.data_ptr() not in weights:
                seen[storage.data_ptr()] = storage.nbytes()
        if backward:
            return tensor
        held.append(tensor)
        return None

    def unpack(saved):
        if saved is None:
            raise RuntimeError("saved_bytes kept nothing for a backward pass; pass backward=True")
        return recompute_unpack(saved)

    with contextlib.ExitStack() as stack:
        recorded = stack.enter_context(recording()) if recompute else None
        stack.enter_context(torch.autograd.graph.saved_tensors_hooks(pack, unpack))
        run()
    held.clear()
    return sum(seen.values())


def _data_ptr(param: torch.Tensor) -> int | None:
    try:
        return param.untyped_storage().data_ptr()
    except RuntimeError:  # a weight FSDP holds sharded has no local storage of its own here
        return None


def measure_cost(model: torch.nn.Module, decoder: torch.nn.Module, vocab_size: int) -> ActivationCost:
    """:class:`ActivationCost` of ``decoder`` with the adapter active now, from one probe forward
    pass of :data:`PROBE_TOKENS` tokens each way (nothing is kept). The probe's input embeddings
    take gradients, so autograd saves what training saves even where no LoRA weight is."""
    device = decoder.get_input_embeddings().weight.device
    ids = torch.randint(0, vocab_size, (1, PROBE_TOKENS), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        embeds = decoder.get_input_embeddings()(ids.to(device))
    embeds.requires_grad_(True)

    def run():
        decoder(inputs_embeds=embeds, use_cache=False)

    with torch.enable_grad():
        plain = saved_bytes(run, model, device, recompute=True)
        everything = saved_bytes(run, model, device)  # without recipes: what a layer holds while it runs
        with checkpointing(model, True):
            stored = saved_bytes(run, model, device)
        grouped, computed = _grouped_probe(model, decoder, ids[0].tolist(), device)
    layers = max(1, len(transformer_layers(model)))
    per_position, layer = plain / PROBE_TOKENS, everything / layers / PROBE_TOKENS
    # what the grouped pass saved beyond its positions' price is its members' copies of the prefix
    repeated = max(0.0, grouped - computed * per_position) / (PROBE_MEMBERS * PROBE_TOKENS // 2)
    return ActivationCost(per_position, stored / PROBE_TOKENS + layer, repeated, layer)


PROBE_MEMBERS = 4  # the grouped probe: this many members share a prefix of PROBE_TOKENS // 2


def _grouped_probe(model, decoder, tokens: list[int], device) -> tuple[int, int]:
    """Bytes autograd saves over a shared-prefix group (:func:`.batched_forward.shared_prefix_pairs`:
    :data:`PROBE_MEMBERS` members, a prefix of half the probe, suffixes of an eighth), and the
    positions it computes."""
    from sess.engine.protocol.types import Datum, ModelInput
    from sess.engine.runtime.batched_forward import shared_prefix_pairs

    prefix, suffix = PROBE_TOKENS // 2, PROBE_TOKENS // 8
    members = [
        Datum(model_input=ModelInput.from_ints(tokens[:prefix] + tokens[prefix + m * suffix :][:suffix]))
        for m in range(PROBE_MEMBERS)
    ]
    targets = [torch.zeros(prefix + suffix, dtype=torch.long) for _ in members]
    saved = saved_bytes(
        lambda: shared_prefix_pairs(decoder, [(members, targets, prefix)]), model, device, recompute=True
    )
    return saved, prefix + PROBE_MEMBERS * suffix


def transformer_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


@contextlib.contextmanager
def checkpointing(model: torch.nn.Module, on: bool) -> Iterator[None]:
    """Activation checkpointing of ``model``'s decoder layers inside this block (``on``), through
    transformers' own per-layer switch, set on this model instance only and restored after. The
    switch acts on layers in training mode, so each layer (not its submodules: no dropout changes)
    is marked training for the block."""
    if not on:
        yield
        return
    layers = transformer_layers(model)
    before = [(transformers_internals.layer_checkpointing(m), m.training) for m in layers]
    func = functools.partial(checkpoint, use_reentrant=False)
    for m in layers:
        transformers_internals.set_layer_checkpointing(m, True, func)
        m.training = True
    try:
        yield
    finally:
        for m, ((flag, old), training) in zip(layers, before):
            transformers_internals.set_layer_checkpointing(m, flag, old)
            m.training = training
