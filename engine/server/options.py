"""An engine's options, defined once: :class:`EngineOptions`, each field with its default and the help
``sess engine up --help`` shows; :meth:`EngineOptions.check`, which refuses what this machine or these
options cannot serve with one line naming the option; and the command line that carries them to an
engine process (:meth:`EngineOptions.argv`, read back by :meth:`EngineOptions.parse`). The CLI's
``sess engine up`` builds its options from these fields, as ``python -m sess.engine.server`` does."""

from __future__ import annotations

import argparse
import math
import ssl
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path

from sess.engine.runtime.distributed.nodes import JOIN_TIMEOUT_S
from sess.engine.server.listen import is_loopback
from sess.engine.server.settings import IDLE_TIMEOUT_S, MAX_BODY_BYTES, MAX_QUEUED, MAX_SESSIONS


def _option(default, help: str, **more):
    return field(default=default, metadata={"help": help, **more})


@dataclass(frozen=True)
class EngineOptions:
    """What ``sess engine up`` and ``python -m sess.engine.server`` are asked for: one field per option
    (``--idle-timeout`` is ``idle_timeout``)."""

    home: str | None = _option(None, "Engine home (default $SESS_HOME or ~/.sess).")
    host: str = _option("127.0.0.1", "Address to bind; non-loopback needs API keys.")
    port: int = _option(0, "Port (0: a free one, recorded in HOME/engine.json).")
    device: str = _option("cpu", "cpu or cuda.")
    idle_timeout: float = _option(
        IDLE_TIMEOUT_S,
        "Seconds a session may go without an op or a client heartbeat; then its state is saved "
        "and it is stopped (sess resume NAME continues it).",
    )
    max_sessions: int = _option(MAX_SESSIONS, "Live sessions per API key (at least 1).")
    max_body_bytes: int = _option(MAX_BODY_BYTES, "Largest request body the engine reads, in bytes.")
    tls_cert: str | None = _option(None, "PEM certificate (chain) to serve https with; needs --tls-key.")
    tls_key: str | None = _option(None, "PEM private key of --tls-cert.")
    dtype: str | None = _option(
        None,
        "Precision of the base models' weights: float32 or bfloat16 (default: float32 on cpu, "
        "bfloat16 on cuda); per model with MODEL=DTYPE, e.g. float32,gpt-oss-20b=bfloat16. LoRA "
        "weights and optimizer state stay float32.",
    )
    memory_budget: str | None = _option(
        None,
        "Memory a training op may hold for activations and output-layer logits, e.g. 1G "
        "(default: 384M on cpu, half the free device memory on cuda); the logits, in chunks, take a "
        "quarter of it. Bigger batches run in micro-batches, a datum that needs more runs with "
        "activation checkpointing (without a budget given, within a quarter of the memory available), "
        "and one too long even then is refused. On cpu the sampler keeps "
        "prepacked copies of the base weights (faster decode steps, as many bytes as the weights) "
        "only where they fit in it; without it, where they take at most a quarter of the free memory.",
    )
    nproc: int = _option(
        1,
        "Ranks (torch.distributed: gloo on cpu, NCCL on cuda), one per CPU core or GPU at most: "
        "base models are sharded with FSDP2 and each rank trains on a share of every batch.",
    )
    prices: str | None = _option(
        None,
        "YAML price table (currency:, models: with prefill/sampled/trained, optionally cached_prefill, "
        "per million tokens; see conf/prices.example.yaml): usage then shows cost, and key budgets are "
        "in its currency.",
    )
    max_queued: int = _option(
        MAX_QUEUED,
        "Ops one API key may have queued or running; past it a submit gets 429 and Retry-After "
        "(the SDKs wait and retry).",
    )
    queue: str = _option("fair", "Order of ops across keys: fair (fair share of engine time) or arrival.")
    sampler: str = _option(
        "builtin",
        "builtin (bit-exact, batch-invariant; the default) or vllm: sample requests go to vLLM, "
        "which loads each base model once and each sampler version's LoRA from its PEFT files; "
        "a live session's current weights are exported for it when they changed.",
    )
    sampler_python: str | None = _option(
        None,
        "With --sampler vllm: the Python of an environment that has vLLM (it pins its own torch "
        "and transformers; default: this Python).",
    )
    sampler_max_lora_rank: int = _option(
        32, "With --sampler vllm: the largest LoRA rank vLLM serves (sessions above it are refused)."
    )
    nnodes: int = _option(
        1,
        "Hosts of one engine, each running --nproc ranks (run `sess engine up` on each, with "
        "the same --nnodes and --master, the same --home on a shared filesystem, and its own "
        "--node-rank); node 0's first rank serves.",
    )
    node_rank: int = _option(0, "This host's place among --nnodes hosts: 0 to --nnodes - 1.")
    master: str | None = _option(
        None, "HOST:PORT of node 0, where the hosts meet (torch.distributed's rendezvous)."
    )
    join_timeout: float = _option(
        JOIN_TIMEOUT_S, "Seconds node 0 waits for every host to join (and another host for node 0)."
    )

    @staticmethod
    def flag(name: str) -> str:
        return "--" + name.replace("_", "-")

    @classmethod
    def help(cls, name: str) -> str:
        return next(f.metadata["help"] for f in fields(cls) if f.name == name)

    @classmethod
    def types(cls) -> dict[str, type]:
        """Each field's value type (``str`` for ``str | None``)."""
        hints = typing.get_type_hints(cls)
        return {
            f.name: next(t for t in typing.get_args(hints[f.name]) or (hints[f.name],) if t is not type(None))
            for f in fields(cls)
        }

    def nodes(self):
        """The hosts of this engine (:class:`~sess.engine.runtime.distributed.nodes.Nodes`, None for
        one); ValueError naming the option."""
        from sess.engine.runtime.distributed.nodes import Nodes

        return Nodes.parse(self.nnodes, self.node_rank, self.master, self.join_timeout)

    def tls(self) -> tuple[str, str] | None:
        """The (certificate, key) paths to serve https with, resolved; None for http."""
        return (
            (str(Path(self.tls_cert).resolve()), str(Path(self.tls_key).resolve())) if self.tls_cert else None
        )

    def check(self) -> str | None:
        """What is wrong with these options on this machine (None: nothing), as one line naming the
        option: a device it does not have or a precision the device cannot compute in, a budget that
        is not a size, a port out of range, a limit no session could live under, a price table that
        cannot be used, an unusable TLS pair, ranks or hosts it cannot run, a sampler it cannot start,
        a public address without API keys. Nothing has started when it is asked."""
        for problem in (self._limits(), self._device(), self._files(), self._shape()):
            if problem:
                return problem
        return None

    def _limits(self) -> str | None:
        if not 0 <= self.port <= 65535:
            return f"--port: expected 1 to 65535 (or 0: any free port), got {self.port}"
        if self.max_queued < 1:
            return f"--max-queued: expected at least 1 queued op per key, got {self.max_queued}"
        if self.max_sessions < 1:
            return f"--max-sessions: expected at least 1 live session per key, got {self.max_sessions}"
        # inf would mean never, but it is no JSON number: /healthz could not report it
        if not (math.isfinite(self.idle_timeout) and self.idle_timeout > 0):
            return (
                f"--idle-timeout: expected a positive number of seconds, got {self.idle_timeout} "
                "(for sessions that practically never time out, give a large one such as 1e9)"
            )
        if self.queue not in ("fair", "arrival"):
            return f"--queue: expected fair or arrival, got {self.queue!r}"
        return None

    def _device(self) -> str | None:
        import torch

        from sess.engine.runtime.memory.training_budget import parse_bytes
        from sess.engine.runtime.models.catalog import Dtypes

        device = self.device
        if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
            return f"--device: expected cpu or cuda, got {device!r}"
        if device.startswith("cuda"):
            if not torch.cuda.is_available():
                return f"--device {device}: this machine has no CUDA device (torch {torch.__version__}); use --device cpu"
            index = torch.device(device).index or 0
            if index >= torch.cuda.device_count():
                return f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s)"
        try:
            Dtypes.parse(self.dtype).check(device)
        except ValueError as exc:
            return f"--dtype: {exc}"
        try:
            if self.memory_budget is not None:
                parse_bytes(self.memory_budget)
        except ValueError as exc:
            return f"--memory-budget: {exc}"
        return None

    def _files(self) -> str | None:
        from sess.engine.protocol.home import sess_home
        from sess.engine.protocol.prices import PriceError
        from sess.engine.server.keys import KeyStore

        if self.prices is not None:
            try:
                load_price_table(self.prices)
            except PriceError as exc:
                return f"--prices: {exc}"
        problem = check_tls(self.tls_cert, self.tls_key)
        if problem:
            return problem
        home = sess_home(self.home)
        if not is_loopback(self.host) and not KeyStore(home).load():
            return f"refusing to listen on {self.host} without API keys; add one first: sess engine keys add --home {home}"
        return None

    def _shape(self) -> str | None:
        from sess.engine.runtime.distributed.launch import check_nproc
        from sess.engine.runtime.vllm.sampler import check_sampler

        try:
            check_nproc(self.nproc, self.device)
            self.nodes()
        except ValueError as exc:
            return str(exc)
        ranks = self.nproc * self.nnodes
        return check_sampler(self.sampler, self.sampler_python, ranks, self.sampler_max_lora_rank)

    def argv(self, *, only: tuple[str, ...] | None = None, skip: tuple[str, ...] = ()) -> list[str]:
        """The command line of these options (those not at their default; of ``only`` when given, but
        ``skip``), as :meth:`parse` reads it back; ``--prices`` resolved, as the engine records it."""
        line = []
        for f in fields(self):
            value = getattr(self, f.name)
            if value == f.default or (only is not None and f.name not in only) or f.name in skip:
                continue
            if f.name == "prices":
                value = Path(value).resolve()
            line += [self.flag(f.name), str(value)]
        return line

    @classmethod
    def parser(cls, prog: str, description: str) -> argparse.ArgumentParser:
        parser = argparse.ArgumentParser(prog=prog, description=description)
        types = cls.types()
        for f in fields(cls):
            parser.add_argument(
                cls.flag(f.name), type=types[f.name], default=f.default, help=f.metadata["help"]
            )
        return parser

    @classmethod
    def parse(cls, argv: list[str] | None, prog: str, description: str, **defaults) -> EngineOptions:
        """The options of a command line (``python -m sess.engine.server``'s); ``defaults`` replace
        the fields' defaults."""
        parser = cls.parser(prog, description)
        parser.set_defaults(**defaults)
        return cls(**vars(parser.parse_args(argv)))

    def recorded(self, ranks: int) -> dict:
        """What ``engine.json`` keeps of these options, for an engine of ``ranks`` ranks in all: what
        ``sess engine up`` compares its own with when it finds the engine running."""
        return {
            "device": self.device,
            "idle_timeout": self.idle_timeout,
            "max_sessions": self.max_sessions,
            "dtype": self.dtype,
            "memory_budget": self.memory_budget,
            "nproc": ranks,
            "prices": str(Path(self.prices).resolve()) if self.prices else None,
            "max_queued": self.max_queued,
            "queue": self.queue,
            "sampler": self.sampler,
        }


def load_price_table(path: str):
    """The price table of ``--prices``, every model in it checked against the catalog."""
    from sess.engine.protocol.prices import load_prices
    from sess.engine.runtime.models.catalog import ModelNotAvailable, resolve

    def known_model(name: str) -> str | None:
        try:
            resolve(name)
        except ModelNotAvailable as exc:
            return str(exc)
        return None

    return load_prices(path, known_model)


def check_tls(cert: str | None, key: str | None) -> str | None:
    """What is wrong with a (certificate, key) pair of PEM files to serve https with (None:
    nothing, or neither given); both or neither."""
    if not cert and not key:
        return None
    if not (cert and key):
        return "--tls-cert and --tls-key go together: give the certificate and its private key"
    for what, path in (("--tls-cert", cert), ("--tls-key", key)):
        if not Path(path).is_file():
            return f"{what}: no file {path}"
    try:  # as uvicorn will load them, but here, before any model loads, with the files named
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(cert, key, password=lambda: b"")
    except (ssl.SSLError, OSError) as exc:
        return (
            f"--tls-cert {cert} / --tls-key {key}: not a PEM certificate (chain) and its unencrypted "
            f"private key ({getattr(exc, 'reason', None) or exc})"
        )
    return None
