"""Continuous batching: every in-flight sample request of one base model decodes in one batch.

A request joins between decode steps: waiting prompts are prefilled together (each once, however
many samples it asks for), the first token of each of its ``num_samples`` rows is drawn from that
prefill, and each row gets a cache row holding its prompt's KV. Rows carry their own position ids,
adapter (each row runs through its own LoRA weights) and sampling settings, and leave the batch the
step they finish. The KV cache lives in preallocated buffers [blocks, rows, heads, 64, dim] in which
each row's entries start at column 0 and its new token is written at its own position, so a decode
step copies nothing that grows with length. A decode step runs through the host's lean step where
it has one (llama-family models, :mod:`.llama_decode`) and through the model's modules otherwise.

Every row's arithmetic is independent of the other rows in the batch (see :mod:`.invariant`), so a
seeded request returns the same tokens and bit-identical logprobs however requests happen to meet.

Models with sliding-window layers (gpt_oss) keep transformers' own cache and decode one request at
a time: correct, not merged.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer

from .invariant import BLOCK, Layout, invariant_rows
from .sampler import StopChecker, choose_tokens, chosen_logprobs, row_keys, uniforms
from .types import SampledSequence, SamplingParams


class SlotLayer(DynamicLayer):
    """KV of the batch's rows in preallocated buffers [blocks, rows, heads, BLOCK, dim]: row ``r``'s
    entries fill columns ``[0, positions[r])`` (column c lives in block c // BLOCK) and a decode
    step writes its new token at column ``positions[r]`` (the batch sets :attr:`step` before
    each step); the rest is zeros. Blocks lead so that the first few are one contiguous tensor for
    the sampler's attention, whatever the capacity."""

    step: WriteStep | None = None

    @classmethod
    def from_rows(cls, keys: torch.Tensor, values: torch.Tensor, capacity: int) -> SlotLayer:
        """From [rows, heads, length, dim] entries, with room for ``capacity`` columns."""
        layer = cls()
        layer.device, layer.is_initialized = keys.device, True
        layer.buf_k, layer.buf_v = _blocked(keys, capacity), _blocked(values, capacity)
        return layer

    @property
    def blocks(self) -> int:
        return self.buf_k.shape[0]

    def update(self, key_states, value_states, *args, **kwargs):
        step = self.step  # where every row writes this step (set once per step for all layers)
        if step.blocks > self.blocks:
            grown = max(step.blocks, self.blocks + (self.blocks + 3) // 4)
            self.buf_k = _pad(self.buf_k, grown, dim=0, left=False)
            self.buf_v = _pad(self.buf_v, grown, dim=0, left=False)
        self.buf_k[step.block, step.rows, :, step.column] = key_states[:, :, 0]
        self.buf_v[step.block, step.rows, :, step.column] = value_states[:, :, 0]
        self.keys, self.values = self.buf_k[: step.blocks], self.buf_v[: step.blocks]
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.step.last if self.step is not None else 0

    # batch surgery (the decode batch calls these between steps) ----------------------------------
    def select_rows(self, rows: torch.Tensor, width: int) -> None:
        """Keep ``rows``, and of their blocks enough for ``width`` columns and some growth."""
        keep = min(self.blocks, 2 * (width // BLOCK + 1))
        self.buf_k, self.buf_v = self.buf_k[:keep, rows], self.buf_v[:keep, rows]

    def append_rows(self, other: SlotLayer) -> None:
        blocks = max(self.blocks, other.blocks)
        self.buf_k = torch.cat(
            [_pad(self.buf_k, blocks, dim=0, left=False), _pad(other.buf_k, blocks, dim=0, left=False)], dim=1
        )
        self.buf_v = torch.cat(
            [_pad(self.buf_v, blocks, dim=0, left=False), _pad(other.buf_v, blocks, dim=0, left=False)], dim=1
        )


def _blocked(entries: torch.Tensor, capacity: int) -> torch.Tensor:
    """[rows, heads, length, dim] -> [blocks, rows, heads, BLOCK, dim], zero-padded to ``capacity``."""
    rows, heads, _, dim = entries.shape
    blocks = -(-capacity // BLOCK)
    padded = _pad(entries, blocks * BLOCK, dim=2, left=False)
    return padded.reshape(rows, heads, blocks, BLOCK, dim).permute(2, 0, 1, 3, 4).contiguous()


def _pad(t: torch.Tensor, width: int, *, dim: int, left: bool = True, fill: float = 0) -> torch.Tensor:
    """``t`` padded with ``fill`` along ``dim`` to ``width`` (on the left by default)."""
    missing = width - t.shape[dim]
    if missing <= 0:
        return t
    shape = list(t.shape)
    shape[dim] = missing
    zeros = t.new_full(shape, fill)
    return torch.cat([zeros, t] if left else [t, zeros], dim=dim)


class WriteStep:
    """Where a decode step writes each row's new KV entry: the same for every layer, so computed once."""

    def __init__(self, positions: torch.Tensor):
        self.last = int(positions.max())
        self.blocks = self.last // BLOCK + 1
        self.rows = torch.arange(positions.shape[0], device=positions.device)
        self.block, self.column = positions // BLOCK, positions % BLOCK
        self.layout = Layout(positions=positions)  # for attention: its mask bias is made once


class SlotCache(DynamicCache):
    def __init__(self, layers: list[SlotLayer]):
        Cache.__init__(self, layers=layers)

    def set_positions(self, positions: torch.Tensor) -> WriteStep:
        step = WriteStep(positions)
        for layer in self.layers:
            layer.step = step
        return step


def supports_merging(model: torch.nn.Module) -> bool:
    config = (
        model.config.get_text_config(decoder=True)
        if hasattr(model.config, "get_text_config")
        else model.config
    )
    layer_types = getattr(config, "layer_types", None) or []
    return (
        not getattr(config, "sliding_window", None)
        or all(t == "full_attention" for t in layer_types)
        and layer_types != []
    )


@dataclass
class SampleJob:
    """One sample request: its prompt, settings, adapter, and where its rows' results go."""

    prompt: list[int]
    num_samples: int
    params: SamplingParams
    adapter: str | None
    stopper: StopChecker
    on_done: Callable[[list[SampledSequence] | None, BaseException | None], None]
    prompt_logprobs: int = 0  # 0: none, -1: logprobs only, k > 0: also top-k
    prompt_result: tuple | None = None
    results: list[SampledSequence | None] = field(default_factory=list)
    rows_left: int = 0

    def finish_row(self, sample: int, tokens: list[int], logprobs: list[float], reason: str) -> None:
        self.results[sample] = SampledSequence(tokens=tokens, logprobs=logprobs, stop_reason=reason)
        self.rows_left -= 1
        if self.rows_left == 0:
            self.on_done(self.results, None)


# Per-row tensors of the batch, kept in row order; rows are selected/concatenated together.
ROW_TENSORS = (
    "positions",
    "last",
    "keys",
    "steps",
    "temperature",
    "top_k",
    "top_p",
    "max_tokens",
    "stop_ids",
    "generated",
    "generated_lp",
)


class DecodeBatch:
    """The running batch of one base model; :meth:`step` admits waiting jobs and decodes one token.

    Per-step work is tensor ops over all rows; Python runs only for rows that finish and for rows
    whose request has stop strings. ``generated`` holds each row's tokens right-aligned: a row that
    joined ``steps[r]`` steps ago owns the last ``steps[r]`` columns."""

    def __init__(self, model_for: Callable, merging: bool, fast_step: Callable | None = None):
        self.model_for = model_for  # adapters of the rows -> context manager of (model, extra forward kwargs)
        # (adapters, tokens, positions, cache) -> logits of a decode step, or None: use the modules
        self.fast_step = fast_step
        self.merging = merging
        self.waiting: list[SampleJob] = []
        self._clear()

    def _clear(self) -> None:
        self.cache: SlotCache | DynamicCache | None = None
        self.jobs: list[SampleJob] = []  # per row
        self.sample_index: list[int] = []  # per row: which sample of its job
        self.adapters: list[str | None] = []  # per row
        self.string_rows: list[int] = []  # rows whose request has stop strings
        for name in ROW_TENSORS:
            setattr(self, name, None)

    @property
    def rows(self) -> int:
        return len(self.jobs)

    @property
    def active(self) -> bool:
        return self.rows > 0 or bool(self.waiting)

    def adapters_in_use(self) -> set[str]:
        return {a for a in self.adapters if a is not None} | {j.adapter for j in self.waiting if j.adapter}

    def submit(self, job: SampleJob) -> None:
        self.waiting.append(job)

    def fail_adapter(self, adapter: str, error: BaseException) -> None:
        """End every request sampling from ``adapter`` (its session stopped) with ``error``."""
        for job in [j for j in self.waiting if j.adapter == adapter]:
            self.waiting.remove(job)
            job.on_done(None, error)
        doomed = {id(j): j for j in self.jobs if j.adapter == adapter}
        if doomed:
            for job in doomed.values():
                job.on_done(None, error)
            self._keep([r for r, j in enumerate(self.jobs) if id(j) not in doomed])

    # joining -------------------------------------------------------------------------------------
    def admit(self) -> None:
        """Prefill waiting jobs into the batch: when merging, all of them in one padded forward
        (a job that wants prompt logprobs goes alone); otherwise one job, when the batch is idle."""
        while self.waiting and (self.merging or self.rows == 0):
            if self.merging and not self.waiting[0].prompt_logprobs:
                jobs = [j for j in self.waiting if not j.prompt_logprobs]
            else:
                jobs = [self.waiting[0]]
            self.waiting = [j for j in self.waiting if all(j is not taken for taken in jobs)]
            try:
                self._join(jobs)
            except BaseException as exc:  # a failed prefill ends its own requests, not the batch
                for job in jobs:
                    job.on_done(None, exc)
            if not self.merging:
                break

    @torch.no_grad()
    def _join(self, jobs: list[SampleJob]) -> None:
        """Prefill ``jobs`` (prompts left-padded into one batch, each attending only to itself),
        draw each sample's first token, give each sample a cache row holding its prompt's KV from
        column 0, and merge the new rows into the running batch."""
        keep = 0 if jobs[0].prompt_logprobs else 1  # logits of the last position only, unless asked
        lengths = [len(job.prompt) for job in jobs]
        width = max(lengths)
        with self.model_for([job.adapter for job in jobs]) as (model, extra), invariant_rows():
            device = next(model.parameters()).device
            ids = torch.zeros(len(jobs), width, dtype=torch.long, device=device)
            positions = torch.zeros_like(ids)
            for row, job in enumerate(jobs):
                ids[row, width - len(job.prompt) :] = torch.tensor(job.prompt, device=device)
                positions[row, width - len(job.prompt) :] = torch.arange(len(job.prompt), device=device)
            if self.merging:
                extra = {**extra, "sess_layout": Layout(prompt_lengths=lengths)}
            out = model(
                input_ids=ids,
                position_ids=positions,
                cache=DynamicCache(config=model.config),
                use_cache=True,
                logits_to_keep=keep,
                **extra,
            )
        logits = out.logits.float()
        if jobs[0].prompt_logprobs:
            jobs[0].prompt_result = prompt_logprobs_from(
                logits[0], jobs[0].prompt, max(jobs[0].prompt_logprobs, 0)
            )
        owner = [row for row, job in enumerate(jobs) for _ in range(job.num_samples)]
        if self.merging:
            cache = SlotCache(
                [
                    SlotLayer.from_rows(
                        _rows_of(layer.keys, lengths, jobs), _rows_of(layer.values, lengths, jobs), width + 16
                    )
                    for layer in out.cache.layers
                ]
            )
        else:
            cache = out.cache
            if len(owner) > len(jobs):
                for layer in cache.layers:
                    layer.batch_select_indices(torch.tensor(owner, device=device))
        rows = len(owner)
        parts: dict[str, list[torch.Tensor]] = {}
        for job in jobs:
            k, p = job.num_samples, job.params
            job.results, job.rows_left = [None] * k, k
            stop_ids = job.stopper.stop_ids or [-1]
            for name, value in {
                "positions": torch.full((k,), len(job.prompt), dtype=torch.long, device=device),
                "keys": row_keys(p.seed, k, device),
                "steps": torch.ones(
                    k, dtype=torch.long, device=device
                ),  # the first token comes from the prefill
                "temperature": torch.full((k,), float(p.temperature), device=device),
                "top_k": torch.full((k,), int(p.top_k), dtype=torch.long, device=device),
                "top_p": torch.full((k,), float(p.top_p), device=device),
                "max_tokens": torch.full((k,), p.max_tokens, dtype=torch.long, device=device),
                "stop_ids": torch.tensor([stop_ids] * k, dtype=torch.long, device=device),
            }.items():
                parts.setdefault(name, []).append(value)
        width_stops = max(t.shape[1] for t in parts["stop_ids"])
        parts["stop_ids"] = [_pad(t, width_stops, dim=1, fill=-1) for t in parts["stop_ids"]]
        new = {name: torch.cat(values) for name, values in parts.items()}
        first = logits[owner, -1]
        draws = uniforms(new["keys"], new["steps"] - 1)
        new["last"] = choose_tokens(first, new["temperature"], new["top_k"], new["top_p"], draws)
        new["generated"] = new["last"][:, None]
        new["generated_lp"] = chosen_logprobs(first, new["last"])[:, None]
        if self.rows == 0:
            self.cache = cache
            for name, value in new.items():
                setattr(self, name, value)
        else:
            for mine, theirs in zip(self.cache.layers, cache.layers):
                mine.append_rows(theirs)
            for name, value in new.items():
                mine = getattr(self, name)
                if name in ("stop_ids", "generated", "generated_lp"):
                    width = max(mine.shape[1], value.shape[1])
                    fill = -1 if name == "stop_ids" else 0
                    mine, value = _pad(mine, width, dim=1, fill=fill), _pad(value, width, dim=1, fill=fill)
                setattr(self, name, torch.cat([mine, value]))
        start = self.rows
        for job in jobs:
            if job.stopper.stop_strings:
                self.string_rows += list(range(start, start + job.num_samples))
            self.jobs += [job] * job.num_samples
            self.sample_index += list(range(job.num_samples))
            self.adapters += [job.adapter] * job.num_samples
            start += job.num_samples
        self._check(slice(self.rows - rows, self.rows))

    # decoding ------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self) -> None:
        """Admit waiting requests, then decode one token for every row."""
        self.admit()
        if self.rows == 0:
            return
        logits = None
        if self.merging:
            step = self.cache.set_positions(self.positions)
            if self.fast_step is not None:
                logits = self.fast_step(self.adapters, self.last, self.positions, self.cache)
        if logits is None:
            with self.model_for(self.adapters) as (model, extra), invariant_rows():
                if self.merging:
                    extra = {**extra, "sess_layout": step.layout}
                out = model(
                    input_ids=self.last[:, None],
                    position_ids=self.positions[:, None],
                    cache=self.cache,
                    use_cache=True,
                    **extra,
                )
            self.cache = out.cache
            logits = out.logits[:, -1]
        logits = logits.float()
        token = choose_tokens(
            logits, self.temperature, self.top_k, self.top_p, uniforms(self.keys, self.steps)
        )
        self.generated = torch.cat([self.generated, token[:, None]], dim=1)
        self.generated_lp = torch.cat([self.generated_lp, chosen_logprobs(logits, token)[:, None]], dim=1)
        self.positions += 1
        self.steps += 1
        self.last = token
        self._check(slice(0, self.rows))

    def _check(self, rows: slice) -> None:
        """Finish the rows in ``rows`` whose newest token stops them or that reached max_tokens."""
        last = self.generated[rows, -1]
        stopped = torch.zeros(self.rows, dtype=torch.bool, device=last.device)
        stopped[rows] = (self.stop_ids[rows] == last[:, None]).any(dim=1)
        for row in self.string_rows:
            if rows.start <= row < rows.stop and not bool(stopped[row]):
                tokens = self.generated[row, -int(self.steps[row]) :].tolist()
                stopped[row] = self.jobs[row].stopper.hit_string(tokens)
        done = torch.zeros_like(stopped)
        done[rows] = stopped[rows] | (self.steps[rows] >= self.max_tokens[rows])
        if not bool(done.any()):
            return
        for row in done.nonzero().flatten().tolist():
            n = int(self.steps[row])
            self.jobs[row].finish_row(
                self.sample_index[row],
                self.generated[row, -n:].tolist(),
                self.generated_lp[row, -n:].tolist(),
                "stop" if bool(stopped[row]) else "length",
            )
        self._keep((~done).nonzero().flatten().tolist())

    def _keep(self, rows: list[int]) -> None:
        if not rows:
            self._clear()
            return
        if len(rows) == self.rows:
            return
        index = torch.tensor(rows, device=self.positions.device)
        for name in ROW_TENSORS:
            setattr(self, name, getattr(self, name)[index])
        for layer in self.cache.layers:
            if self.merging:
                layer.select_rows(index, width=int(self.positions.max()) + 1)
            else:
                layer.batch_select_indices(index)
        position = {old: new for new, old in enumerate(rows)}
        self.string_rows = [position[r] for r in self.string_rows if r in position]
        self.jobs = [self.jobs[r] for r in rows]
        self.sample_index = [self.sample_index[r] for r in rows]
        self.adapters = [self.adapters[r] for r in rows]
        longest = int(self.steps.max())
        self.generated, self.generated_lp = self.generated[:, -longest:], self.generated_lp[:, -longest:]


def _rows_of(prefilled: torch.Tensor, lengths: list[int], jobs: list[SampleJob]) -> torch.Tensor:
    """Cache entries [rows, heads, length, dim] for every sample of ``jobs`` from a left-padded
    prefill's keys or values: each prompt's entries moved to column 0 (zeros after them)."""
    width = prefilled.shape[2]
    parts = [
        _pad(prefilled[row : row + 1, :, width - n :], width, dim=2, left=False).expand(
            job.num_samples, -1, -1, -1
        )
        for row, (n, job) in enumerate(zip(lengths, jobs))
    ]
    return torch.cat(parts)


def prompt_logprobs_from(logits: torch.Tensor, prompt: list[int], topk: int):
    """Prompt logprobs (first None) and optional top-k pairs from a prefill's logits (prompt_len, vocab)."""
    logp = logits.log_softmax(-1)
    chosen = logp[:-1].gather(-1, torch.tensor(prompt[1:], device=logits.device)[:, None]).squeeze(-1)
    top = None
    if topk:
        values, indices = logp[:-1].topk(min(topk, logp.shape[-1]), dim=-1)
        top = [None, *[list(zip(i.tolist(), v.tolist())) for i, v in zip(indices, values)]]
    return [None, *chosen.tolist()], top
