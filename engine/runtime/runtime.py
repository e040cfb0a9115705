"""The runtime's state: base models in memory, sessions, and each base model's decode batch.

The ops themselves are functions over this state, one module per area (``session_ops``,
``training_ops``, ``checkpoint_ops``, ``sampling_ops``), listed with their request types in
:mod:`sess.engine.runtime.ops.table`. The runtime is not thread-safe by design: one executor thread owns torch and calls it
(:mod:`.executor`).

Two modes are chosen when the runtime starts, each an object the ops call without asking which it
is: where the work runs (:attr:`Runtime.placement`, :mod:`.placement`: this process, or several
ranks) and who decodes sample requests (:attr:`Runtime.sampler`, :mod:`.samplers`: the built-in
decode batch, or vLLM).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from sess.engine.protocol.errors import InvalidRequest, NotFound
from sess.engine.protocol.home import sess_home
from sess.engine.protocol.requests import Request
from sess.engine.runtime import session_names
from sess.engine.runtime.memory.malloc_tuning import sampling_heap, trim
from sess.engine.runtime.memory.training_budget import default_budget, default_ceiling, default_copy_budget
from sess.engine.runtime.models.catalog import DTYPES, Dtypes, ModelNotAvailable
from sess.engine.runtime.models.model_host import ModelHost
from sess.engine.runtime.placement import Placement, SingleProcess
from sess.engine.runtime.samplers import BuiltinSampler, Sampler
from sess.engine.runtime.session import Session
from sess.engine.sampling import fused_ops, row_invariant
from sess.engine.sampling.decode_batch import DecodeBatch


class Runtime:
    def __init__(
        self,
        home: str | Path | None = None,
        device: str = "cpu",
        *,
        dtypes: Dtypes | None = None,
        memory_budget: int | None = None,
        placement: Placement | None = None,
        sampler: Sampler | None = None,
    ):
        self.home = sess_home(home)
        self.device = device
        self.dtypes = dtypes or Dtypes()
        self._memory_budget = memory_budget  # the budget given (--memory-budget); None: the default
        self._default_budget: int | None = None  # training_budget.default_budget, sized at first use
        self._copy_budget: int | None = None  # without a budget given: sized once, at first use
        self._default_ceiling: int | None = None  # training_budget.default_ceiling, sized at first use
        self.hosts: dict[str, ModelHost] = {}
        self.sessions: dict[str, Session] = {}
        self.published: set[str] = (
            set()
        )  # sess:// paths every key may read (checkpoints/checkpoint_lifecycle.py)
        self.batches: dict[str, DecodeBatch] = {}  # base model -> its running decode batch
        self._adapters = 0
        # this process, or its place among the engine's ranks (--nproc: distributed/ranks.py)
        self.placement: Placement = SingleProcess() if placement is None else placement
        # the built-in decode batch, or vLLM (--sampler vllm: vllm/sampler.py)
        self.sampler: Sampler = BuiltinSampler() if sampler is None else sampler
        self._work: str | None = None  # "train" or "sample": what the engine last started (entering)

    def batch_invariance(self, *, check: bool = False) -> dict:
        """Whether sampling gives each row the same bits in any batch on this machine: the
        calibration of every matmul kernel met so far (:func:`.row_invariant.report`) and whether a
        step's attention, norms and token draws run in C (``fused_ops``: :func:`.fused_ops.status`); ``check``
        first calibrates the typical shapes (on the executor thread, as the engine does at start)."""
        report = row_invariant.self_check(self.device) if check else row_invariant.report()
        return {**report, "fused_ops": fused_ops.status()}

    # lookups ---------------------------------------------------------------------------------------
    def host(self, base_model: str) -> ModelHost:
        """The base model ``base_model`` in memory, loaded on first use."""
        if base_model not in self.hosts:

            def make() -> ModelHost:
                dtype = DTYPES[self.dtypes.name_for(base_model, self.device)]
                return ModelHost(
                    base_model,
                    self.home,
                    self.device,
                    dtype=dtype,
                    memory_budget=lambda: self.memory_budget,
                    copy_budget=self.copy_budget,
                )

            try:
                self.hosts[base_model] = self.placement.load_host(base_model, make, ModelNotAvailable)
            except ModelNotAvailable as exc:
                raise NotFound(f"base_model: {exc}") from None
        return self.hosts[base_model]

    @property
    def last_work(self) -> str | None:
        """What the engine last started: ``"train"``, ``"sample"`` or None (see :meth:`entering`)."""
        return self._work

    @property
    def memory_budget(self) -> int:
        """Bytes a training op may hold in activations (the engine's ``--memory-budget``)."""
        if self._memory_budget is not None:
            return self._memory_budget
        if self._default_budget is None:
            self._default_budget = default_budget(self.device)
        return self._default_budget

    @memory_budget.setter
    def memory_budget(self, value: int | None) -> None:
        self._memory_budget = value  # None: back to the default

    @property
    def memory_ceiling(self) -> int:
        """The most a training op may hold for one datum too long for :attr:`memory_budget`'s
        micro-batches: the budget given, else a share of the memory available when first asked
        (:func:`.training_budget.default_ceiling`)."""
        if self.budget_given:
            return self.memory_budget
        if self._default_ceiling is None:
            self._default_ceiling = max(self.memory_budget, default_ceiling(self.device))
        return self._default_ceiling

    @property
    def budget_given(self) -> bool:
        """Whether the memory budget was set (``--memory-budget``) rather than sized by default."""
        return self._memory_budget is not None

    def copy_budget(self) -> int:
        """Bytes the sampler's prepacked copies of the base weights may take: the budget given
        (``--memory-budget``), else a share of the memory free when first asked
        (:func:`.training_budget.default_copy_budget`), kept from then on so the copies, once made,
        do not talk themselves out of fitting."""
        if self.budget_given:
            return self.memory_budget
        if self._copy_budget is None:
            self._copy_budget = default_copy_budget(self.device)
        return self._copy_budget

    def session(self, owner: str, name: str, *, live: bool = True) -> Session:
        """``owner``'s session ``name`` (another key's is not found); ``live``: it must be running."""
        session = self.find_session(owner, name)
        if session is None:
            raise NotFound(f"session {name!r} not found")
        if live and not session.live:
            raise InvalidRequest(
                f"session {name!r} is {session.status.value}; resume it to continue (sess resume {name})",
                status=409,
            )
        return session

    def find_session(self, owner: str, name: str) -> Session | None:
        """``owner``'s session ``name``: as its client names it, or by its engine id (session_names.py)."""
        return session_names.find(self.sessions, owner, name)

    def new_adapter_name(self) -> str:
        """A peft adapter name for a new session (session names may hold '.' or 'lora', so the
        engine picks its own)."""
        self._adapters += 1
        return f"session{self._adapters}"

    def prepare(self, name: str, owner: str, request: Request | None) -> Request | None:
        """Called by the executor before op ``name`` runs; returns the request to run. With several
        ranks, rank 0 sends it to the others or gathers the weights it needs
        (:meth:`sess.engine.runtime.distributed.ranks.Ranks.prepare`)."""
        return self.placement.prepare(self, name, owner, request)

    def full_weights(self) -> None:
        """With several ranks: rank 0 is about to use the base weights alone; gather them."""
        self.placement.full_weights()

    # memory ----------------------------------------------------------------------------------------
    def entering(self, work: str) -> None:
        """Training (``"train"``: a backward pass with no sampling in flight) or sampling
        (``"sample"``: a decode step) runs. Where the engine switches from one to the other, it
        hands the heap's free memory back first (:func:`sess.engine.runtime.memory.malloc_tuning.trim`): the blocks one kind freed
        are of sizes the other's seldom fits, so they stay free and, in a heap never trimmed while
        the engine works, resident. A loop that samples and trains at once never switches, and a
        run of training ops (or of sample requests) trims at most once, so pages freed between its
        steps are reused without faulting in again. The training side trims after the first op has
        measured what a position costs (its probes' blocks go back too)."""
        if self._work is not None and self._work != work:
            trim()
        self._work = work

    @contextlib.contextmanager
    def sampling(self):
        """A decode step runs in the block: :meth:`entering` sampling, and the step's big blocks (its
        logits, the batch's KV cache) in heap pages the step or batch before freed
        (:func:`~sess.engine.runtime.memory.malloc_tuning.sampling_heap`)."""
        self.entering("sample")  # trims only where training came last
        with sampling_heap():
            yield

    # decoding --------------------------------------------------------------------------------------
    def batch(self, host: ModelHost) -> DecodeBatch:
        """The running decode batch of ``host``'s base model."""
        if host.name not in self.batches:
            self.batches[host.name] = DecodeBatch(host.decoder)
            host.pinned = self.batches[host.name].adapters_in_use
        return self.batches[host.name]

    @property
    def decoding(self) -> bool:
        return any(batch.active for batch in self.batches.values())

    def decode_step(self) -> None:
        """Admit waiting sample requests and decode one token for every running row."""
        self.full_weights()
        with self.sampling():
            for batch in list(self.batches.values()):
                if batch.active:
                    batch.step()

    def fail_decoding(self, error: BaseException) -> None:
        """End every running and waiting sample request with ``error`` (after a failed step)."""
        for batch in self.batches.values():
            batch.fail_all(error)
