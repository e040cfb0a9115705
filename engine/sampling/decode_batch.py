"""Continuous batching: every in-flight sample request of one base model decodes in one batch.

A request joins between decode steps: its decoder prefills the waiting prompts together (each once,
however many samples it asks for), the first token of each of its ``num_samples`` rows is drawn
from that prefill, and each row gets a cache row holding its prompt's KV. Rows carry their own
positions, adapter (each row runs through its own LoRA weights) and sampling settings, and leave
the batch the step they finish. Per step, the work over rows is tensor ops; Python runs only for
rows that finish and for rows whose request has stop strings.

The decoder (:mod:`.decoder`) does the model's arithmetic: the lean llama decoder merges every
request into the batch and keeps each row's arithmetic independent of the others
(:mod:`.row_invariant`), so a seeded request returns the same tokens and bit-identical logprobs
however requests happen to meet; the module decoder (other architectures) takes one request at a
time, which keeps the same promise by never sharing a batch.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from sess.engine.protocol.types import SampledSequence, SamplingParams
from sess.engine.sampling.decoder import Decoder
from sess.engine.sampling.token_choice import (
    StopChecker,
    choose,
    prompt_logprobs_from,
    row_keys,
    uniforms,
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
    # several ranks: the request's target as rank 0 hands it to another rank to decode
    # ({"session"}, {"model_path"} or {"base_model"}; runtime/distributed/sample_spread.py); None: here
    target: dict | None = None
    prompt_result: tuple | None = None
    # a listener of the request's tokens as they are drawn (a server streaming them), or None: its
    # ``token(sample, token_id, logprob)`` runs on the executor thread after each draw, and its
    # ``cancelled`` flag, once set, ends the request's rows with the tokens drawn so far
    progress: Any = None
    results: list[SampledSequence | None] = field(default_factory=list)
    rows_left: int = 0
    seconds: float = 0.0  # its share of the prefills and decode steps it took part in
    # its prompt's first tokens the prefill did not compute: found in the :mod:`.prefix_cache`, or
    # computed once for it and an earlier prompt of the same prefill (:mod:`.prefill_layout`)
    cached_tokens: int = 0
    prefix_key: tuple | None = None  # the weights its prompt's entries were kept under (None: not kept)

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

    def __init__(self, decoder: Decoder):
        self.decoder = decoder
        self.waiting: list[SampleJob] = []
        # several ranks, on rank 0: hands waiting requests to the other ranks, which decode them in
        # the same steps (runtime/distributed_sampling.Spread); None: every request decodes here
        self.spread = None
        self._clear()

    def _clear(self) -> None:
        self.cache = None  # the decoder's cache of the running rows
        self.jobs: list[SampleJob] = []  # per row
        self.sample_index: list[int] = []  # per row: which sample of its job
        self.adapters: list[str | None] = []  # per row
        self.string_rows: list[int] = []  # rows whose request has stop strings
        self.progress_rows: list[int] = []  # rows whose request has a progress listener
        for name in ROW_TENSORS:
            setattr(self, name, None)

    @property
    def rows(self) -> int:
        return len(self.jobs)

    @property
    def active(self) -> bool:
        return self.rows > 0 or bool(self.waiting) or bool(self.spread and self.spread.elsewhere)

    def adapters_in_use(self) -> set[str]:
        elsewhere = [job for _, job in self.spread.elsewhere.values()] if self.spread else []
        return {a for a in self.adapters if a is not None} | {
            j.adapter for j in self.waiting + elsewhere if j.adapter
        }

    def submit(self, job: SampleJob) -> None:
        self.waiting.append(job)

    def fail_all(self, error: BaseException) -> None:
        """End every running and waiting request with ``error`` (after a failed step)."""
        for job in {id(j): j for j in self.jobs + self.waiting}.values():
            job.on_done(None, error)
        self.waiting.clear()
        self._clear()
        if self.spread is not None:
            self.spread.fail_all(error)

    def fail_adapter(self, adapter: str, error: BaseException) -> None:
        """End every request sampling from ``adapter`` (its session stopped) with ``error``."""
        if self.spread is not None:
            self.spread.fail_adapter(adapter, error)
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
        """Prefill waiting jobs into the batch: when the decoder merges requests, all of them at
        once (a job that wants prompt logprobs goes alone); otherwise one job, when the batch is idle."""
        merges = self.decoder.merges
        while self.waiting and (merges or self.rows == 0):
            if merges and not self.waiting[0].prompt_logprobs:
                jobs = self._within_slots([j for j in self.waiting if not j.prompt_logprobs])
            else:
                jobs = self._within_slots([self.waiting[0]])
            if not jobs:  # every adapter slot is taken: they wait for rows to finish
                break
            self.waiting = [j for j in self.waiting if all(j is not taken for taken in jobs)]
            try:
                self._join(jobs)
            except BaseException as exc:  # a failed prefill ends its own requests, not the batch
                for job in jobs:
                    job.on_done(None, exc)
            if not merges:
                break

    def _within_slots(self, jobs: list[SampleJob]) -> list[SampleJob]:
        """The jobs, in order, whose adapters fit the decoder's adapter slots beside those of the
        rows already running (base-model rows take none)."""
        slots = self.decoder.adapter_slots()
        if slots is None:
            return jobs
        held = {a for a in self.adapters if a is not None}
        taken = []
        for job in jobs:
            if job.adapter is None or job.adapter in held or len(held) < slots:
                taken.append(job)
                if job.adapter is not None:
                    held.add(job.adapter)
        return taken

    @torch.no_grad()
    def _join(self, jobs: list[SampleJob]) -> None:
        """Prefill ``jobs``, draw each sample's first token, and merge their rows (each with a cache
        row holding its prompt's KV) into the running batch."""
        started = time.perf_counter()
        prefill = self.decoder.prefill(jobs)
        device = prefill.last_logits.device
        if jobs[0].prompt_logprobs:
            job = jobs[0]
            job.prompt_result = prompt_logprobs_from(
                prefill.prompt_logits.float(), job.prompt, max(job.prompt_logprobs, 0)
            )
        owner = [row for row, job in enumerate(jobs) for _ in range(job.num_samples)]
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
        parts["stop_ids"] = [_pad_left(t, width_stops, dim=1, fill=-1) for t in parts["stop_ids"]]
        new = {name: torch.cat(values) for name, values in parts.items()}
        first = prefill.last_logits.float()[owner]
        draws = uniforms(new["keys"], new["steps"] - 1)
        new["last"], logprobs = choose(first, new["temperature"], new["top_k"], new["top_p"], draws)
        new["generated"] = new["last"][:, None]
        new["generated_lp"] = logprobs[:, None]
        if self.rows == 0:
            self.cache = prefill.cache
            for name, value in new.items():
                setattr(self, name, value)
        else:
            self.cache.append(prefill.cache)
            for name, value in new.items():
                mine = getattr(self, name)
                if name in ("stop_ids", "generated", "generated_lp"):
                    width = max(mine.shape[1], value.shape[1])
                    fill = -1 if name == "stop_ids" else 0
                    mine, value = (
                        _pad_left(mine, width, dim=1, fill=fill),
                        _pad_left(value, width, dim=1, fill=fill),
                    )
                setattr(self, name, torch.cat([mine, value]))
        start = self.rows
        for job in jobs:
            if job.stopper.stop_strings:
                self.string_rows += list(range(start, start + job.num_samples))
            if job.progress is not None:
                self.progress_rows += list(range(start, start + job.num_samples))
            self.jobs += [job] * job.num_samples
            self.sample_index += list(range(job.num_samples))
            self.adapters += [job.adapter] * job.num_samples
            start += job.num_samples
        _share(time.perf_counter() - started, {id(job): (job, len(job.prompt)) for job in jobs})
        self._check(slice(self.rows - rows, self.rows))

    # decoding ------------------------------------------------------------------------------------
    def step(self) -> None:
        """Admit waiting requests, then decode one token for every row. With several ranks, rank 0
        first hands waiting requests to the other ranks, which decode theirs in the same step, and
        takes back the ones they finished after its own rows' step."""
        if self.spread is None:
            self._step()
            return
        self.spread.before(self)
        try:
            self._step()
        finally:
            self.spread.after(self)

    @torch.no_grad()
    def _step(self) -> None:
        self.admit()
        if self.rows == 0:
            return
        started = time.perf_counter()
        logits = self.decoder.step(self.cache, self.adapters, self.last, self.positions)
        token, logprobs = choose(
            logits, self.temperature, self.top_k, self.top_p, uniforms(self.keys, self.steps)
        )
        self.generated = torch.cat([self.generated, token[:, None]], dim=1)
        self.generated_lp = torch.cat([self.generated_lp, logprobs[:, None]], dim=1)
        self.positions += 1
        self.steps += 1
        self.last = token
        rows: dict[int, tuple[SampleJob, int]] = {}
        for job in self.jobs:
            rows[id(job)] = (job, rows.get(id(job), (job, 0))[1] + 1)
        _share(time.perf_counter() - started, rows)
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
        for row in self.progress_rows:
            if rows.start <= row < rows.stop:
                progress = self.jobs[row].progress
                progress.token(
                    self.sample_index[row], int(last[row - rows.start]), float(self.generated_lp[row, -1])
                )
                if progress.cancelled:  # its client went away: the tokens drawn so far are its answer
                    done[row] = True
        if not bool(done.any()):
            return
        finished = getattr(self.decoder, "finished", None)  # it may keep the row's entries
        for row in done.nonzero().flatten().tolist():
            n = int(self.steps[row])
            if finished is not None:
                finished(self.cache, row, self.jobs[row], self.generated[row, -n:].tolist())
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
        self.cache.keep(index, width=int(self.positions.max()) + 1)
        position = {old: new for new, old in enumerate(rows)}
        self.string_rows = [position[r] for r in self.string_rows if r in position]
        self.progress_rows = [position[r] for r in self.progress_rows if r in position]
        self.jobs = [self.jobs[r] for r in rows]
        self.sample_index = [self.sample_index[r] for r in rows]
        self.adapters = [self.adapters[r] for r in rows]
        longest = int(self.steps.max())
        self.generated, self.generated_lp = self.generated[:, -longest:], self.generated_lp[:, -longest:]


def _pad_left(t: torch.Tensor, width: int, *, dim: int, fill: float = 0) -> torch.Tensor:
    """``t`` padded with ``fill`` at the start of ``dim`` to ``width`` (generated tokens are
    right-aligned, so a row's newest token stays in the last column)."""
    missing = width - t.shape[dim]
    if missing <= 0:
        return t
    shape = list(t.shape)
    shape[dim] = missing
    return torch.cat([t.new_full(shape, fill), t], dim=dim)


def _share(seconds: float, weights: dict[int, tuple[SampleJob, int]]) -> None:
    """Split ``seconds`` of engine time among jobs by weight (rows in a step, tokens in a prefill)."""
    total = sum(weight for _, weight in weights.values())
    for job, weight in weights.values():
        job.seconds += seconds * weight / total
