"""Continuous batching: every in-flight sample request of one base model decodes in one batch.

A request joins between decode steps: its prompt is prefilled once (batch 1), the first token of
each of its ``num_samples`` rows is drawn from that prefill, and the prompt's KV cache is repeated
for its rows and merged into the running batch. Rows are left-aligned by padding (masked), carry
their own position ids, adapter (peft mixed-adapter batches: each row runs through its own LoRA
weights) and sampling settings, and leave the batch the step they finish. The KV cache lives in
preallocated buffers that grow by doubling, so a decode step copies nothing that grows with length.

Models with sliding-window layers (gpt_oss) keep transformers' own cache and decode one request at
a time: correct, not merged.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer

from .sampler import StopChecker, choose_tokens, row_keys, uniforms
from .types import SampledSequence, SamplingParams


class SlotLayer(DynamicLayer):
    """A KV layer over preallocated buffers [rows, heads, capacity, dim]; keys/values are views."""

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        shape = (*key_states.shape[:2], max(16, 2 * key_states.shape[2]), key_states.shape[3])
        self.buf_k = key_states.new_zeros(shape)
        self.buf_v = value_states.new_zeros((*shape[:3], value_states.shape[3]))
        self.length = 0
        self.is_initialized = True

    def _reserve(self, needed: int) -> None:
        capacity = self.buf_k.shape[2]
        if needed <= capacity:
            return
        new = max(needed, 2 * capacity)
        self.buf_k, self.buf_v = (
            _pad(self.buf_k, new, dim=2, left=False),
            _pad(self.buf_v, new, dim=2, left=False),
        )

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = key_states.shape[2]
        self._reserve(self.length + n)
        self.buf_k[:, :, self.length : self.length + n] = key_states
        self.buf_v[:, :, self.length : self.length + n] = value_states
        self.length += n
        self.keys, self.values = self.buf_k[:, :, : self.length], self.buf_v[:, :, : self.length]
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length if self.is_initialized else 0

    # batch surgery (the decode batch calls these between steps) ----------------------------------
    def _set(self, k: torch.Tensor, v: torch.Tensor) -> None:
        self.buf_k, self.buf_v, self.length = k, v, k.shape[2]
        self._reserve(self.length + 16)
        self.keys, self.values = self.buf_k[:, :, : self.length], self.buf_v[:, :, : self.length]

    def repeat_rows(self, repeats: int) -> None:
        self._set(self.keys.repeat_interleave(repeats, dim=0), self.values.repeat_interleave(repeats, dim=0))

    def select_rows(self, rows: torch.Tensor) -> None:
        self._set(self.keys[rows], self.values[rows])

    def drop_leading(self, columns: int) -> None:
        self._set(self.keys[:, :, columns:], self.values[:, :, columns:])

    def append_rows(self, other: SlotLayer) -> None:
        """Stack ``other``'s rows under these, left-padding the shorter side with zeros."""
        width = max(self.length, other.length)
        keys = torch.cat([_pad(self.keys, width, dim=2), _pad(other.keys, width, dim=2)])
        values = torch.cat([_pad(self.values, width, dim=2), _pad(other.values, width, dim=2)])
        self._set(keys, values)


def _pad(t: torch.Tensor, width: int, *, dim: int, left: bool = True, fill: float = 0) -> torch.Tensor:
    """``t`` padded with ``fill`` along ``dim`` to ``width`` (on the left by default)."""
    missing = width - t.shape[dim]
    if missing <= 0:
        return t
    shape = list(t.shape)
    shape[dim] = missing
    zeros = t.new_full(shape, fill)
    return torch.cat([zeros, t] if left else [t, zeros], dim=dim)


class SlotCache(DynamicCache):
    def __init__(self, num_layers: int):
        Cache.__init__(self, layers=[SlotLayer() for _ in range(num_layers)])


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

    def __init__(self, model_for: Callable, num_layers: int, merging: bool):
        self.model_for = model_for  # adapters of the rows -> context manager of (model, extra forward kwargs)
        self.num_layers = num_layers
        self.merging = merging
        self.waiting: list[SampleJob] = []
        self._clear()

    def _clear(self) -> None:
        self.cache: SlotCache | DynamicCache | None = None
        self.jobs: list[SampleJob] = []  # per row
        self.sample_index: list[int] = []  # per row: which sample of its job
        self.adapters: list[str | None] = []  # per row
        self.string_rows: list[int] = []  # rows whose request has stop strings
        self.mask = None
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
        """Prefill ``jobs`` (prompts left-padded into one batch), draw each sample's first token,
        repeat each prompt's KV rows for its samples and merge them into the running batch."""
        keep = 0 if jobs[0].prompt_logprobs else 1  # logits of the last position only, unless asked
        width = max(len(job.prompt) for job in jobs)
        with self.model_for([job.adapter for job in jobs]) as (model, extra):
            device = next(model.parameters()).device
            cache = SlotCache(self.num_layers) if self.merging else DynamicCache(config=model.config)
            ids = torch.zeros(len(jobs), width, dtype=torch.long, device=device)
            mask = torch.zeros(len(jobs), width, dtype=torch.long, device=device)
            for row, job in enumerate(jobs):
                ids[row, width - len(job.prompt) :] = torch.tensor(job.prompt, device=device)
                mask[row, width - len(job.prompt) :] = 1
            if len(jobs) == 1:  # no padding: let the model take its plain causal path
                out = model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=keep, **extra)
            else:
                positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
                out = model(
                    input_ids=ids,
                    attention_mask=mask,
                    position_ids=positions,
                    cache=cache,
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
        if len(owner) > len(jobs):
            index = torch.tensor(owner, device=device)
            for layer in out.cache.layers:
                if self.merging:
                    layer.select_rows(index)
                else:
                    layer.batch_select_indices(index)
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
        new["generated_lp"] = first.log_softmax(-1).gather(-1, new["last"][:, None])
        mask = mask[owner]
        if self.rows == 0:
            self.cache, self.mask = out.cache, mask
            for name, value in new.items():
                setattr(self, name, value)
        else:
            width = max(self.mask.shape[1], mask.shape[1])
            self.mask = torch.cat([_pad(self.mask, width, dim=1), _pad(mask, width, dim=1)])
            for mine, theirs in zip(self.cache.layers, out.cache.layers):
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
        self.mask = torch.cat([self.mask, self.mask.new_ones((self.rows, 1))], dim=1)
        with self.model_for(self.adapters) as (model, extra):
            out = model(
                input_ids=self.last[:, None],
                attention_mask=self.mask,
                position_ids=self.positions[:, None],
                cache=self.cache,
                use_cache=True,
                **extra,
            )
        self.cache = out.cache
        logits = out.logits[:, -1].float()
        token = choose_tokens(
            logits, self.temperature, self.top_k, self.top_p, uniforms(self.keys, self.steps)
        )
        self.generated = torch.cat([self.generated, token[:, None]], dim=1)
        self.generated_lp = torch.cat(
            [self.generated_lp, logits.log_softmax(-1).gather(-1, token[:, None])], dim=1
        )
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
        index = torch.tensor(rows, device=self.mask.device)
        for layer in self.cache.layers:
            if self.merging:
                layer.select_rows(index)
            else:
                layer.batch_select_indices(index)
        for name in ROW_TENSORS:
            setattr(self, name, getattr(self, name)[index])
        self.mask = self.mask[index]
        position = {old: new for new, old in enumerate(rows)}
        self.string_rows = [position[r] for r in self.string_rows if r in position]
        self.jobs = [self.jobs[r] for r in rows]
        self.sample_index = [self.sample_index[r] for r in rows]
        self.adapters = [self.adapters[r] for r in rows]
        longest = int(self.steps.max())
        self.generated, self.generated_lp = self.generated[:, -longest:], self.generated_lp[:, -longest:]
        if self.merging:  # columns that are padding for every remaining row are dead weight
            dead = int((self.mask.sum(dim=0) == 0).long().cumprod(dim=0).sum())
            if dead:
                self.mask = self.mask[:, dead:]
                for layer in self.cache.layers:
                    layer.drop_leading(dead)


def prompt_logprobs_from(logits: torch.Tensor, prompt: list[int], topk: int):
    """Prompt logprobs (first None) and optional top-k pairs from a prefill's logits (prompt_len, vocab)."""
    logp = logits.log_softmax(-1)
    chosen = logp[:-1].gather(-1, torch.tensor(prompt[1:], device=logits.device)[:, None]).squeeze(-1)
    top = None
    if topk:
        values, indices = logp[:-1].topk(min(topk, logp.shape[-1]), dim=-1)
        top = [None, *[list(zip(i.tolist(), v.tolist())) for i, v in zip(indices, values)]]
    return [None, *chosen.tolist()], top
