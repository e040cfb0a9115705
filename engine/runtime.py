"""The model host: base models, per-session LoRA adapters with their AdamW state, and the ops.

Every op is a method of :class:`Runtime` that takes plain data (wire dicts, ints, strings) and
returns plain data, so the in-process transport, the HTTP server and torch.distributed ranks can all
drive it the same way. The runtime is not thread-safe by design: one executor thread owns torch and
calls it (see ``service.py``).
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from . import checkpoints as ckpt
from .decoding import DecodeBatch, SampleJob
from .forward import plan, prompt_logprobs, shared_prefix_logprobs, token_logprobs
from .host import BaseHost
from .losses import check_data, check_loss_fn, compute_loss
from .models import ModelNotAvailable, list_models
from .paths import sess_home
from .sampler import StopChecker
from .saving import CheckpointOps
from .types import (
    AdamParams,
    Datum,
    ForwardBackwardOutput,
    InvalidRequest,
    NotFound,
    SampleResponse,
    SamplingParams,
    SessError,
    SessionStatus,
    TensorData,
    TrainingSessionSummary,
    Usage,
)


@dataclass
class Session:
    name: str
    owner: str
    base_model: str
    lora: dict
    adapter: str = ""  # peft adapter name: engine-chosen, since session names may hold '.' or 'lora'
    user_metadata: dict | None = None
    status: SessionStatus = SessionStatus.Running
    created: float = field(default_factory=time.time)
    last_active: float = field(default_factory=time.time)
    step: int = 0
    saves: int = 0
    usage: Usage = field(default_factory=Usage)
    optimizer: torch.optim.AdamW | None = None
    params: dict[str, torch.nn.Parameter] = field(default_factory=dict)

    def summary(self) -> dict:
        return TrainingSessionSummary(
            name=self.name,
            base_model=self.base_model,
            status=self.status,
            created=self.created,
            last_active=self.last_active,
            step=self.step,
            usage=self.usage,
            user_metadata=self.user_metadata,
            lora=self.lora,
        ).to_wire()


class Runtime(CheckpointOps):
    def __init__(self, home: str | Path | None = None, device: str = "cpu"):
        self.home = sess_home(home)
        self.device = device
        self.hosts: dict[str, BaseHost] = {}
        self.sessions: dict[str, Session] = {}
        self.batches: dict[str, DecodeBatch] = {}  # base model -> its running decode batch
        self._adapters = 0

    # models ----------------------------------------------------------------------------------------
    def host(self, base_model: str) -> BaseHost:
        if not isinstance(base_model, str) or not base_model:
            raise InvalidRequest(f"base_model: expected a model name, got {base_model!r}")
        if base_model not in self.hosts:
            try:
                self.hosts[base_model] = BaseHost(base_model, self.home, self.device)
            except ModelNotAvailable as exc:
                raise NotFound(f"base_model: {exc}") from None
        return self.hosts[base_model]

    def list_base_models(self, owner: str) -> list[str]:
        return sorted(set(list_models()) | set(self.hosts))

    def tokenizer_files(self, owner: str, base_model: str) -> dict[str, str]:
        path = self.host(base_model).path
        return {n: (path / n).read_text() for n in ckpt.TOKENIZER_FILES if (path / n).exists()}

    # sessions --------------------------------------------------------------------------------------
    def session(self, owner: str, name: str, *, live: bool = True) -> Session:
        session = self.sessions.get(name)
        if session is None or session.owner != owner:
            raise NotFound(f"session {name!r} not found")
        if live and session.status != SessionStatus.Running:
            raise InvalidRequest(
                f"session {name!r} is {session.status.value}; resume it to continue", status=409
            )
        return session

    def create_session(
        self,
        owner: str,
        base_model: str,
        *,
        name: str | None = None,
        rank: int = 32,
        alpha: float = 64,
        seed: int | None = None,
        train_mlp: bool = True,
        train_attn: bool = True,
        train_unembed: bool = True,
        user_metadata: dict | None = None,
    ) -> dict:
        if not isinstance(rank, int) or isinstance(rank, bool) or not 1 <= rank <= 1024:
            raise InvalidRequest(f"rank: expected an integer in 1..1024, got {rank!r}")
        if not isinstance(alpha, int | float) or alpha <= 0:
            raise InvalidRequest(f"alpha: expected a positive number, got {alpha!r}")
        if seed is not None and (not isinstance(seed, int) or seed < 0):
            raise InvalidRequest(f"seed: expected a non-negative integer, got {seed!r}")
        if not (train_mlp or train_attn or train_unembed):
            raise InvalidRequest("train_mlp, train_attn, train_unembed: at least one must be true")
        name = ckpt.check_name(
            name or f"{base_model.replace('/', '-')[:40]}-{secrets.token_hex(3)}", "training_session_name"
        )
        if name in self.sessions:
            raise InvalidRequest(
                f"training_session_name: a session named {name!r} already exists", status=409
            )
        host = self.host(base_model)
        seed = secrets.randbits(31) if seed is None else seed
        lora = {
            "rank": rank,
            "alpha": alpha,
            "seed": seed,
            "train_mlp": train_mlp,
            "train_attn": train_attn,
            "train_unembed": train_unembed,
        }
        self._adapters += 1
        adapter = f"session{self._adapters}"
        host.add_adapter(adapter, host.lora_config(rank, alpha, train_attn, train_mlp, train_unembed), seed)
        session = Session(name, owner, base_model, lora, adapter=adapter, user_metadata=user_metadata)
        session.params = host.adapter_params(adapter)
        session.optimizer = torch.optim.AdamW(list(session.params.values()), lr=1e-4, foreach=False)
        self.sessions[name] = session
        return session.summary()

    def create_session_from_state(
        self, owner: str, path: str, *, name: str | None = None, with_optimizer: bool
    ) -> dict:
        _, _, _, meta = ckpt.read_state(self._checkpoint_dir(owner, path))
        lora = meta["lora"]
        summary = self.create_session(owner, meta["base_model"], name=name, **lora)
        try:
            self.load_state(owner, summary["name"], path, with_optimizer=with_optimizer)
        except BaseException:
            self.delete_session(owner, summary["name"], stop_if_active=True)
            raise
        return self.sessions[summary["name"]].summary()

    def stop_session(self, owner: str, name: str) -> dict:
        session = self.session(owner, name, live=False)
        if session.status == SessionStatus.Running:
            if session.base_model in self.batches:
                stopped = InvalidRequest(
                    f"session {name!r} was stopped while this request was sampling from it", status=409
                )
                self.batches[session.base_model].fail_adapter(session.adapter, stopped)
            self.hosts[session.base_model].remove_adapter(session.adapter)
            session.optimizer, session.params = None, {}
            session.status = SessionStatus.Stopped
        return session.summary()

    def delete_session(self, owner: str, name: str, *, stop_if_active: bool = False) -> dict:
        """Forget a session and delete its checkpoints, files included (a running one is refused
        unless ``stop_if_active``)."""
        session = self.session(owner, name, live=False)
        if session.status == SessionStatus.Running:
            if not stop_if_active:
                raise InvalidRequest(
                    f"session {name!r} is running; stop it first or pass stop_if_active=True", status=409
                )
            self.stop_session(owner, name)
        del self.sessions[name]
        self._delete_checkpoints(session)
        return session.summary()

    def list_sessions(
        self,
        owner: str,
        name_contains: str | None = None,
        status_equals: str | None = None,
        max_results: int | None = None,
    ) -> list[dict]:
        found = [
            s.summary()
            for s in sorted(self.sessions.values(), key=lambda s: s.created)
            if s.owner == owner
            and (name_contains is None or name_contains in s.name)
            and (status_equals is None or s.status.value == status_equals)
        ]
        return found[:max_results] if max_results else found

    def get_usage(self, owner: str, name: str | None = None) -> dict:
        if name is not None:
            return self.session(owner, name, live=False).usage.to_wire()
        total = Usage()
        for session in self.sessions.values():
            if session.owner == owner:
                total = total.add(session.usage)
        return total.to_wire()

    def _account(self, session: Session, started: float, **counts: int) -> None:
        session.usage = session.usage.add(
            Usage(wall_time_s=time.perf_counter() - started, operations=1, **counts)
        )
        session.last_active = time.time()

    # training ops ----------------------------------------------------------------------------------
    def forward(
        self,
        owner: str,
        session: str,
        data: list[dict],
        loss_fn: str = "cross_entropy",
        loss_fn_config: dict | None = None,
    ) -> dict:
        return self._forward(owner, session, data, loss_fn, loss_fn_config, backward=False)

    def forward_backward(
        self,
        owner: str,
        session: str,
        data: list[dict],
        loss_fn: str = "cross_entropy",
        loss_fn_config: dict | None = None,
    ) -> dict:
        return self._forward(owner, session, data, loss_fn, loss_fn_config, backward=True)

    def _forward(self, owner, session_name, data, loss_fn, loss_fn_config, *, backward: bool) -> dict:
        started = time.perf_counter()
        session = self.session(owner, session_name)
        host = self.hosts[session.base_model]
        loss_fn, config = check_loss_fn(loss_fn, loss_fn_config)
        datums = _read_data(data)
        check_data(datums, loss_fn, vocab_size=host.vocab_size)
        inputs = [{k: v.to_torch() for k, v in d.loss_fn_inputs.items()} for d in datums]
        all_lps: list[torch.Tensor | None] = [None] * len(datums)
        targets = [x["target_tokens"] for x in inputs]
        batches = plan(datums, host.vocab_size, share_prefixes=host.shares_prefixes)
        with host.activate(session.adapter) as model, torch.set_grad_enabled(backward):
            for padded, groups in batches:
                if groups:
                    per_group = shared_prefix_logprobs(
                        model,
                        [
                            ([datums[i] for i in idx], [targets[i] for i in idx], shared)
                            for idx, shared in groups
                        ],
                    )
                    indices = [i for idx, _ in groups for i in idx]
                    lps = [lp for group in per_group for lp in group]
                else:
                    indices = padded
                    lps = token_logprobs(model, [datums[i] for i in indices], [targets[i] for i in indices])
                if backward:
                    loss, _ = compute_loss(loss_fn, config, lps, [inputs[i] for i in indices])
                    loss.backward()
                for i, lp in zip(indices, lps):
                    all_lps[i] = lp.detach()
        with torch.no_grad():
            _, metrics = compute_loss(loss_fn, config, all_lps, inputs)
        self._account(session, started, training_tokens=sum(d.model_input.length for d in datums))
        outputs = [{"logprobs": TensorData.from_torch(lp.float())} for lp in all_lps]
        return ForwardBackwardOutput(loss_fn_outputs=outputs, metrics=metrics).to_wire()

    def optim_step(self, owner: str, session: str, adam_params: dict | None = None) -> dict:
        started = time.perf_counter()
        session = self.session(owner, session)
        try:
            adam = AdamParams(**(adam_params or {}))
        except TypeError as exc:
            raise InvalidRequest(f"adam_params: {exc}") from None
        adam.validate()
        params = list(session.params.values())
        grads = [p.grad for p in params if p.grad is not None]
        grad_norm = (
            torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
            if grads
            else torch.tensor(0.0)
        )
        if not torch.isfinite(grad_norm):
            session.optimizer.zero_grad(set_to_none=True)
            raise InvalidRequest(
                "gradients are not finite (NaN or inf); they were discarded and the weights left unchanged"
            )
        if adam.grad_clip_norm > 0 and grads:
            torch.nn.utils.clip_grad_norm_(params, adam.grad_clip_norm)
        for group in session.optimizer.param_groups:
            group.update(
                lr=adam.learning_rate,
                betas=(adam.beta1, adam.beta2),
                eps=adam.eps,
                weight_decay=adam.weight_decay,
            )
        session.optimizer.step()
        session.optimizer.zero_grad(set_to_none=True)
        session.step += 1
        self._account(session, started)
        return {
            "metrics": {
                "grad_norm": float(grad_norm),
                "learning_rate": adam.learning_rate,
                "step": session.step,
            }
        }

    # sampling --------------------------------------------------------------------------------------
    def _sampling_target(self, owner: str, target: dict) -> tuple[BaseHost, str | None, Session | None]:
        if target.get("session"):
            session = self.session(owner, target["session"])
            return self.hosts[session.base_model], session.adapter, session
        if target.get("model_path"):
            ref = ckpt.parse_path(target["model_path"], field="model_path")
            session = self.session(owner, ref.session, live=False)
            host = self.host(session.base_model)
            return host, self._checkpoint_sampler(host, ref), session
        if target.get("base_model"):
            return self.host(target["base_model"]), None, None
        raise InvalidRequest("sampling client: give model_path or base_model")

    def start_sample(
        self,
        owner: str,
        on_done: Callable[[dict | None, BaseException | None, Usage], None],
        target: dict,
        prompt: list[int],
        num_samples: int = 1,
        sampling_params: dict | None = None,
        include_prompt_logprobs: bool = False,
        topk_prompt_logprobs: int | None = None,
    ) -> None:
        """Check a sample request and add it to its base model's decode batch.

        Raises at once for bad input; later ``on_done(result_wire, error, usage)`` runs on the
        executor thread when the request's last row finishes (see :meth:`decode_step`)."""
        started = time.perf_counter()
        host, adapter, session = self._sampling_target(owner, target)
        try:
            params = SamplingParams(**(sampling_params or {}))
        except TypeError as exc:
            raise InvalidRequest(f"sampling_params: {exc}") from None
        params.validate()
        if not isinstance(num_samples, int) or isinstance(num_samples, bool) or not 1 <= num_samples <= 1024:
            raise InvalidRequest(f"num_samples: expected an integer in 1..1024, got {num_samples!r}")
        prompt = _check_prompt(prompt, host.vocab_size)
        if len(prompt) + params.max_tokens > host.max_context:
            raise InvalidRequest(
                f"sampling_params.max_tokens: prompt ({len(prompt)}) + max_tokens ({params.max_tokens}) "
                f"exceeds the model's context of {host.max_context} tokens"
            )
        if topk_prompt_logprobs is not None and (
            not isinstance(topk_prompt_logprobs, int)
            or isinstance(topk_prompt_logprobs, bool)
            or topk_prompt_logprobs < 1
        ):
            raise InvalidRequest(
                f"topk_prompt_logprobs: expected a positive integer, got {topk_prompt_logprobs!r}"
            )

        def finished(sequences, error) -> None:
            usage = Usage()
            if error is None:
                response = SampleResponse(sequences=sequences)
                if job.prompt_result is not None:
                    logprobs, top = job.prompt_result
                    response.prompt_logprobs = logprobs if include_prompt_logprobs else None
                    response.topk_prompt_logprobs = top
                sampled = sum(len(s.tokens) for s in sequences)
                usage = Usage(prefill_tokens=len(prompt), sampled_tokens=sampled)
                if session is not None:
                    self._account(session, started, prefill_tokens=len(prompt), sampled_tokens=sampled)
                on_done(response.to_wire(), None, usage)
            else:
                on_done(None, error, usage)

        job = SampleJob(
            prompt=prompt,
            num_samples=num_samples,
            params=params,
            adapter=adapter,
            stopper=StopChecker(params.stop, host.eos_ids, host.tokenizer.decode),
            on_done=finished,
            prompt_logprobs=(topk_prompt_logprobs or -1)
            if (include_prompt_logprobs or topk_prompt_logprobs)
            else 0,
        )
        self._batch(host).submit(job)

    def _batch(self, host: BaseHost) -> DecodeBatch:
        if host.name not in self.batches:
            self.batches[host.name] = DecodeBatch(host.rows_model, host.shares_prefixes, host.decode_step)
            host.pinned = self.batches[host.name].adapters_in_use
        return self.batches[host.name]

    @property
    def decoding(self) -> bool:
        return any(batch.active for batch in self.batches.values())

    def decode_step(self) -> None:
        """Admit waiting sample requests and decode one token for every running row."""
        for batch in list(self.batches.values()):
            if batch.active:
                batch.step()

    def fail_decoding(self, error: BaseException) -> None:
        """End every running and waiting sample request with ``error`` (after a failed step)."""
        for batch in self.batches.values():
            for job in {id(j): j for j in batch.jobs + batch.waiting}.values():
                job.on_done(None, error)
            batch.waiting.clear()
            batch._clear()

    def sample(self, owner: str, **request) -> dict:
        """Sample synchronously: :meth:`start_sample`, then decode until this request finishes."""
        done: list = []
        self.start_sample(owner, lambda result, error, usage: done.append((result, error)), **request)
        while not done:
            self.decode_step()
        result, error = done[0]
        if error is not None:
            raise error
        return result

    def compute_logprobs(self, owner: str, target: dict, prompt: list[int]) -> dict:
        started = time.perf_counter()
        host, adapter, session = self._sampling_target(owner, target)
        prompt = _check_prompt(prompt, host.vocab_size)
        with host.activate(adapter) as model:
            logprobs, _ = prompt_logprobs(model, prompt, None)
        if session is not None:
            self._account(session, started, prefill_tokens=len(prompt))
        return {"logprobs": logprobs}


def _read_data(data) -> list[Datum]:
    if not isinstance(data, list):
        raise InvalidRequest("data: expected a list of datums")
    datums = []
    for i, wire in enumerate(data):
        try:
            datums.append(wire if isinstance(wire, Datum) else Datum.from_wire(wire))
        except SessError as exc:
            raise InvalidRequest(f"data[{i}]: {exc}") from None
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidRequest(f"data[{i}]: malformed datum ({type(exc).__name__}: {exc})") from None
    return datums


def _check_prompt(prompt, vocab_size: int) -> list[int]:
    if (
        not isinstance(prompt, list)
        or not prompt
        or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    ):
        raise InvalidRequest("prompt: expected a non-empty list of token ids")
    bad = next((t for t in prompt if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidRequest(f"prompt: token id {bad} is outside the vocabulary (0..{vocab_size - 1})")
    return prompt
