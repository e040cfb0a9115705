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
        grow = lambda buf: torch.cat(
            [buf, buf.new_zeros((*buf.shape[:2], new - capacity, buf.shape[3]))], dim=2
        )  # noqa: E731
        self.buf_k, self.buf_v = grow(self.buf_k), grow(self.buf_v)

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
        a_k, a_v, b_k, b_v = self.keys, self.values, other.keys, other.values
        width = max(a_k.shape[2], b_k.shape[2])
        pad = lambda t: torch.cat([t.new_zeros((*t.shape[:2], width - t.shape[2], t.shape[3])), t], dim=2)  # noqa: E731
        self._set(torch.cat([pad(a_k), pad(b_k)]), torch.cat([pad(a_v), pad(b_v)]))


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
    tokens: list[list[int]] = field(default_factory=list)
    logprobs: list[list[float]] = field(default_factory=list)
    reasons: list[str] = field(default_factory=list)
    rows_left: int = 0


class DecodeBatch:
    """The running batch of one base model; :meth:`join` adds a job, :meth:`step` decodes one token."""

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
        self.mask = self.positions = self.last = self.keys = self.steps = None
        self.temperature = self.top_k = self.top_p = self.max_tokens = None

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
        doomed = {id(j) for j in self.jobs if j.adapter == adapter}
        if doomed:
            for job in {id(j): j for j in self.jobs if id(j) in doomed}.values():
                job.on_done(None, error)
            self._keep([r for r, j in enumerate(self.jobs) if id(j) not in doomed])

    # joining -------------------------------------------------------------------------------------
    def admit(self) -> None:
        """Prefill waiting jobs into the batch (all of them when merging; else one when idle)."""
        while self.waiting and (self.merging or self.rows == 0):
            job = self.waiting.pop(0)
            try:
                self._join(job)
            except BaseException as exc:  # a failure of one request must not stop the others
                job.on_done(None, exc)
            if not self.merging:
                break

    @torch.no_grad()
    def _join(self, job: SampleJob) -> None:
        with self.model_for([job.adapter]) as (model, extra):
            device = next(model.parameters()).device
            cache = SlotCache(self.num_layers) if self.merging else DynamicCache(config=model.config)
            out = model(
                input_ids=torch.tensor([job.prompt], device=device), cache=cache, use_cache=True, **extra
            )
        logits = out.logits[0].float()
        if job.prompt_logprobs:
            job.prompt_result = prompt_logprobs_from(logits, job.prompt, max(job.prompt_logprobs, 0))
        k = job.num_samples
        job.tokens, job.logprobs = [[] for _ in range(k)], [[] for _ in range(k)]
        job.reasons, job.rows_left = ["length"] * k, k
        p = job.params
        keys = row_keys(p.seed, k, device)
        first = logits[-1:].expand(k, -1)
        temperature = torch.full((k,), float(p.temperature), device=device)
        top_k = torch.full((k,), int(p.top_k), device=device, dtype=torch.long)
        top_p = torch.full((k,), float(p.top_p), device=device)
        steps = torch.zeros(k, dtype=torch.long, device=device)
        token = choose_tokens(first, temperature, top_k, top_p, uniforms(keys, steps))
        chosen_lp = first.log_softmax(-1).gather(-1, token[:, None]).squeeze(-1)
        if k > 1:
            for layer in out.cache.layers:
                (layer.repeat_rows if self.merging else layer.batch_repeat_interleave)(k)
        n = len(job.prompt)
        new = {
            "mask": torch.ones(k, n, dtype=torch.long, device=device),
            "positions": torch.full((k,), n, dtype=torch.long, device=device),
            "last": token,
            "keys": keys,
            "steps": steps + 1,
            "temperature": temperature,
            "top_k": top_k,
            "top_p": top_p,
            "max_tokens": torch.full((k,), p.max_tokens, dtype=torch.long, device=device),
        }
        if self.rows == 0:
            self.cache = out.cache
            for name, value in new.items():
                setattr(self, name, value)
        else:
            width = max(self.mask.shape[1], n)
            pad = lambda m: torch.cat([m.new_zeros((m.shape[0], width - m.shape[1])), m], dim=1)  # noqa: E731
            self.mask = torch.cat([pad(self.mask), pad(new.pop("mask"))])
            for mine, theirs in zip(self.cache.layers, out.cache.layers):
                mine.append_rows(theirs)
            for name, value in new.items():
                setattr(self, name, torch.cat([getattr(self, name), value]))
        self.jobs += [job] * k
        self.sample_index += list(range(k))
        self.adapters += [job.adapter] * k
        self._record(list(range(self.rows - k, self.rows)), token, chosen_lp)

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
        chosen_lp = logits.log_softmax(-1).gather(-1, token[:, None]).squeeze(-1)
        self.positions += 1
        self.steps += 1
        self.last = token
        self._record(list(range(self.rows)), token, chosen_lp)

    def _record(self, rows: list[int], token: torch.Tensor, chosen_lp: torch.Tensor) -> None:
        """Append each row's new token; finish rows that stopped and jobs whose rows all finished."""
        tokens, lps = token.tolist(), chosen_lp.tolist()
        steps = self.steps.tolist()
        limits = self.max_tokens.tolist()
        keep: list[int] = []
        for i, row in enumerate(rows):
            job, sample = self.jobs[row], self.sample_index[row]
            job.tokens[sample].append(tokens[i])
            job.logprobs[sample].append(lps[i])
            stopped = tokens[i] in job.stopper.stop_ids or (
                job.stopper.stop_strings and job.stopper.hit_string(job.tokens[sample])
            )
            if stopped:
                job.reasons[sample] = "stop"
            if stopped or steps[row] >= limits[row]:
                job.rows_left -= 1
                if job.rows_left == 0:
                    job.on_done(
                        [
                            SampledSequence(t, lp, r)
                            for t, lp, r in zip(job.tokens, job.logprobs, job.reasons)
                        ],
                        None,
                    )
            else:
                keep.append(row)
        if len(keep) < len(rows):
            touched = set(rows)
            self._keep(sorted([r for r in range(self.rows) if r not in touched] + keep))

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
        for name in (
            "mask",
            "positions",
            "last",
            "keys",
            "steps",
            "temperature",
            "top_k",
            "top_p",
            "max_tokens",
        ):
            setattr(self, name, getattr(self, name)[index])
        self.jobs = [self.jobs[r] for r in rows]
        self.sample_index = [self.sample_index[r] for r in rows]
        self.adapters = [self.adapters[r] for r in rows]
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
