"""The engine process: bind a socket, build the managed engine and its app, serve until a signal.

Run it with ``sess engine up`` or ``python -m sess.engine.server --home DIR --port N``. The running
engine writes ``engine.json`` (url, pid, port) into its home, which the launcher and the CLI read.
With ``--tls-cert`` and ``--tls-key`` (PEM files, handed to uvicorn) it serves https, for an
engine that other machines reach: keys then never cross the network in clear text.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

from sess.engine.sdk.home import atomic_write_bytes, sess_home
from sess.engine.server import engine_log, registry_guard, registry_repair
from sess.engine.server.registry_guard import RegistryUnreadable
from sess.engine.server.serve_checks import bind, check_options, check_tls, is_loopback, load_price_table
from sess.engine.server.settings import (
    ENGINE_FILE,
    IDLE_TIMEOUT_S,
    KEEP_ALIVE_S,
    MAX_BODY_BYTES,
    MAX_CONNECTIONS,
    MAX_HEAD_BYTES,
    MAX_QUEUED,
    MAX_SESSIONS,
)

START_LOCK_FD_ENV = "SESS_ENGINE_START_LOCK_FD"


def release_start_lock() -> None:
    """Close the start lock handed down by ``sess engine up`` (if any): this engine is findable now."""
    fd = os.environ.pop(START_LOCK_FD_ENV, None)
    if fd is not None:
        try:
            os.close(int(fd))
        except (OSError, ValueError):
            pass


def serve(
    home: str | Path | None = None,
    host: str = "127.0.0.1",
    port: int = 0,
    device: str = "cpu",
    idle_timeout: float = IDLE_TIMEOUT_S,
    max_sessions: int = MAX_SESSIONS,
    max_body_bytes: int = MAX_BODY_BYTES,
    tls_cert: str | None = None,
    tls_key: str | None = None,
    dtype: str | None = None,
    memory_budget: str | None = None,
    ranks=None,
    prices: str | None = None,
    max_queued: int | None = MAX_QUEUED,
    fair: bool = True,
    sampler: str = "builtin",
    sampler_python: str | None = None,
    sampler_max_lora_rank: int = 32,
) -> None:
    """Run an engine in this process until SIGINT/SIGTERM; writes ``engine.json`` into the home.

    ``ranks`` (rank 0 of several, :mod:`.serve_ranks`): the engine leads the other ranks.
    ``sampler="vllm"``: sample requests go to vLLM, run by ``sampler_python`` (:mod:`sess.engine.runtime.vllm.sampler`)."""
    import uvicorn

    from sess.engine.runtime.memory.training_budget import parse_bytes
    from sess.engine.runtime.models.catalog import Dtypes
    from sess.engine.runtime.runtime import Runtime
    from sess.engine.server.billing import Billing
    from sess.engine.server.connections import BoundedH11Protocol
    from sess.engine.server.http_app import create_app
    from sess.engine.server.keys import KeyStore
    from sess.engine.server.managed_engine import ManagedEngine

    problem = check_options(
        device,
        dtype,
        memory_budget,
        port=port,
        idle_timeout=idle_timeout,
        max_sessions=max_sessions,
        max_queued=max_queued,
    )
    if problem:
        raise SystemExit(f"sess engine: {problem}")
    try:
        price_table = load_price_table(prices) if prices else None
    except ValueError as exc:
        raise SystemExit(f"sess engine: --prices: {exc}") from None
    from sess.engine.runtime.vllm.sampler import VllmSampler, check_sampler

    nproc = 1 if ranks is None else ranks.world
    problem = check_sampler(sampler, sampler_python, nproc, sampler_max_lora_rank)
    if problem:
        raise SystemExit(f"sess engine: {problem}")
    home = sess_home(home)
    keys = KeyStore(home)
    if not is_loopback(host) and not keys.load():
        raise SystemExit(
            f"refusing to listen on {host} without API keys: add one first (sess engine keys add --home {home})"
        )
    keys.ensure_local_key()
    try:
        tls = check_tls(tls_cert, tls_key)
    except SystemExit as exc:
        raise SystemExit(f"sess engine: {exc}") from None
    if not is_loopback(host) and not tls:
        print(
            f"warning: serving plain http on {host}: API keys cross the network in clear text; "
            "pass --tls-cert and --tls-key to serve https",
            file=sys.stderr,
            flush=True,
        )
    try:
        sock = bind(host, port)
    except SystemExit as exc:
        raise SystemExit(f"sess engine: {exc}") from None
    port = sock.getsockname()[1]
    lost = registry_guard.problem(home)
    if lost:
        sock.close()
        raise SystemExit(f"sess engine: {lost}")
    runtime = Runtime(
        home,
        device,
        dtypes=Dtypes.parse(dtype),
        memory_budget=parse_bytes(memory_budget) if memory_budget else None,
        placement=ranks,  # None: this process alone
        sampler=(
            VllmSampler(sampler_python or sys.executable, home, max_lora_rank=sampler_max_lora_rank)
            if sampler == "vllm"
            else None  # the built-in decode batch
        ),
    )
    try:
        engine = ManagedEngine(
            home,
            device,
            runtime=runtime,
            idle_timeout=idle_timeout,
            max_sessions=max_sessions,
            session_limits=lambda owner: next(
                (e.get("max_sessions") for e in keys.load().values() if e["owner"] == owner), None
            ),
            billing=lambda registry: Billing(registry, keys, price_table, max_queued),
            fair=fair,
        )
    except RegistryUnreadable as exc:
        sock.close()
        raise SystemExit(f"sess engine: {exc}") from None
    engine.registry.backup()  # registry.db.bak: what a lost registry is restored from
    registry_repair.label_unlabelled(engine.registry, home)  # checkpoints from before manifests
    if ranks is not None:
        from sess.engine.runtime.distributed.follower import session_snapshot

        engine.run(lambda runtime: ranks.send(session_snapshot(runtime)))
    invariance = engine.run(lambda runtime: runtime.batch_invariance(check=True))
    if not invariance["exact"]:
        print(
            "warning: on this CPU sampling is not batch-invariant: a request's logprobs may differ in "
            f"their last bits with what shares its batch ({'; '.join(invariance['inexact'])}); "
            "replaying a run still gives the same numbers",
            file=sys.stderr,
            flush=True,
        )
    url_host = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    info = {
        "url": f"{'https' if tls else 'http'}://{url_host}:{port}",
        "pid": os.getpid(),
        "host": host,
        "port": port,
        "started": time.time(),
        **({"tls_cert": tls[0]} if tls else {}),
        # what `sess engine up` compares its options with when it finds this engine running
        "options": {
            "device": device,
            "idle_timeout": idle_timeout,
            "max_sessions": max_sessions,
            "dtype": dtype,
            "memory_budget": memory_budget,
            "nproc": 1 if ranks is None else ranks.world,
            "prices": str(Path(prices).resolve()) if prices else None,
            "max_queued": max_queued,
            "queue": "fair" if fair else "arrival",
            "sampler": sampler,
        },
    }
    if ranks is not None:  # the agent's pid stops the engine; rank 0's answers /healthz
        info.update(pid=os.getppid(), serving_pid=os.getpid(), rank_pids=ranks.pids)
    atomic_write_bytes(home / ENGINE_FILE, json.dumps(info).encode())
    release_start_lock()  # a start waiting on the lock now finds this engine (it answers once served)
    app = create_app(engine, keys, max_body_bytes=max_body_bytes)
    config = uvicorn.Config(
        app,
        http=BoundedH11Protocol,  # uvicorn's h11 protocol with read timeouts and a per-client cap
        log_level="warning",
        log_config=None,  # uvicorn's loggers go through the engine's (rotating) log
        timeout_keep_alive=KEEP_ALIVE_S,
        h11_max_incomplete_event_size=MAX_HEAD_BYTES,
        limit_concurrency=MAX_CONNECTIONS,
        access_log=False,
        lifespan="off",
        timeout_graceful_shutdown=3,
        **({"ssl_certfile": tls[0], "ssl_keyfile": tls[1]} if tls else {}),
    )
    server = uvicorn.Server(config)
    print(f"sess engine serving {info['url']} (home {home}, pid {os.getpid()})", flush=True)
    try:
        server.run(sockets=[sock])
    finally:
        try:
            written = json.loads((home / ENGINE_FILE).read_text())
            if written.get("serving_pid", written.get("pid")) == os.getpid():
                (home / ENGINE_FILE).unlink()
        except (OSError, ValueError):
            pass
        engine.close()
        runtime.sampler.close()
        if ranks is not None:
            ranks.close()


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m sess.engine.server", description=__doc__.splitlines()[0])
    parser.add_argument("--home", default=None)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=int(os.environ.get("SESS_PORT", 0)))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--idle-timeout", type=float, default=IDLE_TIMEOUT_S)
    parser.add_argument("--max-sessions", type=int, default=MAX_SESSIONS, help="live sessions per key")
    parser.add_argument("--max-body-bytes", type=int, default=MAX_BODY_BYTES)
    parser.add_argument("--tls-cert", default=None, help="PEM certificate (chain): serve https")
    parser.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    parser.add_argument("--dtype", default=None, help="float32, bfloat16, or DEFAULT,MODEL=DTYPE,...")
    parser.add_argument(
        "--memory-budget",
        default=None,
        help="memory a training op may hold for activations and logits, e.g. 1G (sess engine up --help)",
    )
    parser.add_argument(
        "--nproc",
        type=int,
        default=1,
        help="ranks (torch.distributed, FSDP2): one per CPU core or GPU at most",
    )
    parser.add_argument("--prices", default=None, help="YAML price table (per million tokens)")
    parser.add_argument("--max-queued", type=int, default=MAX_QUEUED, help="queued ops per key")
    parser.add_argument("--queue", choices=("fair", "arrival"), default="fair", help="order across keys")
    parser.add_argument("--sampler", default="builtin", help="builtin or vllm (sess engine up --help)")
    parser.add_argument("--sampler-python", default=None, help="the Python of an environment with vLLM")
    parser.add_argument("--sampler-max-lora-rank", type=int, default=32, help="largest LoRA rank vLLM serves")
    parser.add_argument("--nnodes", type=int, default=1, help="hosts of the engine (each runs --nproc ranks)")
    parser.add_argument("--node-rank", type=int, default=0, help="this host's place, 0 to --nnodes - 1")
    parser.add_argument("--master", default=None, help="HOST:PORT of node 0, where the hosts meet")
    parser.add_argument(
        "--join-timeout", type=float, default=None, help="seconds to wait for every host to join (300)"
    )
    args = parser.parse_args(argv)
    from sess.engine.runtime.distributed.nodes import JOIN_TIMEOUT_S, Nodes

    try:  # before any rank starts
        nodes = Nodes.parse(
            args.nnodes,
            args.node_rank,
            args.master,
            JOIN_TIMEOUT_S if args.join_timeout is None else args.join_timeout,
        )
    except ValueError as exc:
        raise SystemExit(f"sess engine: {exc}") from None
    problem = check_options(
        args.device,
        args.dtype,
        args.memory_budget,
        port=args.port,
        idle_timeout=args.idle_timeout,
        max_sessions=args.max_sessions,
        prices=args.prices,
        max_queued=args.max_queued,
    )
    if problem:  # before any rank starts
        raise SystemExit(f"sess engine: {problem}")
    ranks = None
    if args.nproc != 1 or nodes is not None:
        from sess.engine.runtime.distributed.launch import RANKS_ENV, check_nproc

        try:
            check_nproc(args.nproc, args.device)
        except ValueError as exc:
            raise SystemExit(f"sess engine: {exc}") from None
        from sess.engine.server import serve_ranks

        if RANKS_ENV not in os.environ:  # the agent: start the ranks, each runs this command line
            release_start_lock()  # rank 0 writes engine.json; the agent would hold the lock for good
            command = sys.argv[1:] if argv is None else argv
            sys.exit(serve_ranks.run_agent(args.nproc, command, args.home, nodes))
        from sess.engine.runtime.distributed.ranks import Ranks

        ranks = Ranks(args.device)
        args.device = ranks.device
        if not ranks.leader:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            serve_ranks.follow_rank(args.home, ranks, args.dtype, args.memory_budget)
            sys.exit(0)
    engine_log.configure(sess_home(args.home))
    signal.signal(signal.SIGTERM, _interrupt)  # uvicorn re-raises it after a graceful shutdown
    try:
        serve(
            args.home,
            args.host,
            args.port,
            args.device,
            args.idle_timeout,
            args.max_sessions,
            args.max_body_bytes,
            args.tls_cert,
            args.tls_key,
            args.dtype,
            args.memory_budget,
            ranks,
            args.prices,
            args.max_queued,
            args.queue == "fair",
            args.sampler,
            args.sampler_python,
            args.sampler_max_lora_rank,
        )
    except KeyboardInterrupt:
        pass
    sys.exit(0)
