"""The engine process: bind a socket, build the managed engine and its app, serve until a signal.

Run it with ``sess engine up`` or ``python -m sess.engine.server --home DIR --port N``. The running
engine writes ``engine.json`` (url, pid, port) into its home, which the launcher and the CLI read.
With ``--tls-cert`` and ``--tls-key`` (PEM files, handed to uvicorn) it serves https, for an
engine that other machines reach: keys then never cross the network in clear text.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import sys
import time

from sess.engine.protocol.home import atomic_write_bytes, sess_home
from sess.engine.server import engine_log, registry_guard, registry_repair
from sess.engine.server.listen import bind, is_loopback
from sess.engine.server.options import EngineOptions, load_price_table
from sess.engine.server.registry_guard import RegistryUnreadable
from sess.engine.server.settings import ENGINE_FILE, KEEP_ALIVE_S, MAX_CONNECTIONS, MAX_HEAD_BYTES

START_LOCK_FD_ENV = "SESS_ENGINE_START_LOCK_FD"


def release_start_lock() -> None:
    """Close the start lock handed down by ``sess engine up`` (if any): this engine is findable now."""
    fd = os.environ.pop(START_LOCK_FD_ENV, None)
    if fd is not None:
        try:
            os.close(int(fd))
        except (OSError, ValueError):
            pass


def serve(options: EngineOptions, ranks=None) -> None:
    """Run an engine with ``options`` (as :meth:`EngineOptions.check` passed them) in this process until
    SIGINT/SIGTERM; writes ``engine.json`` into the home.

    ``ranks`` (rank 0 of several, :mod:`.rank_agent`): the engine leads the other ranks.
    ``options.sampler == "vllm"``: sample requests go to vLLM, run by ``options.sampler_python``
    (:mod:`sess.engine.runtime.vllm.sampler`)."""
    import uvicorn

    from sess.engine.runtime.memory.training_budget import parse_bytes
    from sess.engine.runtime.models.catalog import Dtypes
    from sess.engine.runtime.runtime import Runtime
    from sess.engine.runtime.vllm.sampler import VllmSampler
    from sess.engine.server.billing import Billing
    from sess.engine.server.connections import BoundedH11Protocol
    from sess.engine.server.http_app import create_app
    from sess.engine.server.keys import KeyStore
    from sess.engine.server.managed_engine import ManagedEngine

    o = options
    host, port, device = o.host, o.port, o.device
    price_table = load_price_table(o.prices) if o.prices else None
    home = sess_home(o.home)
    keys = KeyStore(home)
    keys.ensure_local_key()
    tls = o.tls()
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
        dtypes=Dtypes.parse(o.dtype),
        memory_budget=parse_bytes(o.memory_budget) if o.memory_budget else None,
        placement=ranks,  # None: this process alone
        sampler=(
            VllmSampler(o.sampler_python or sys.executable, home, max_lora_rank=o.sampler_max_lora_rank)
            if o.sampler == "vllm"
            else None  # the built-in decode batch
        ),
    )
    try:
        engine = ManagedEngine(
            home,
            device,
            runtime=runtime,
            idle_timeout=o.idle_timeout,
            max_sessions=o.max_sessions,
            session_limits=lambda owner: next(
                (e.get("max_sessions") for e in keys.load().values() if e["owner"] == owner), None
            ),
            billing=lambda registry: Billing(registry, keys, price_table, o.max_queued),
            fair=o.queue == "fair",
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
        "options": o.recorded(1 if ranks is None else ranks.world),
    }
    if ranks is not None:  # the agent's pid stops the engine; rank 0's answers /healthz
        info.update(pid=os.getppid(), serving_pid=os.getpid(), rank_pids=ranks.pids)
    atomic_write_bytes(home / ENGINE_FILE, json.dumps(info).encode())
    release_start_lock()  # a start waiting on the lock now finds this engine (it answers once served)
    app = create_app(engine, keys, max_body_bytes=o.max_body_bytes)
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
    """``python -m sess.engine.server [options]``: check the options, then serve here, start the ranks
    (as the agent of ``--nproc``/``--nnodes``) or follow rank 0 (as one of those ranks)."""
    options = EngineOptions.parse(
        argv,
        "python -m sess.engine.server",
        __doc__.splitlines()[0],
        port=int(os.environ.get("SESS_PORT", 0)),  # the option's default here, not sess engine up's
    )
    problem = options.check()
    if problem:  # before any rank starts
        raise SystemExit(f"sess engine: {problem}")
    nodes = options.nodes()
    ranks = None
    if options.nproc != 1 or nodes is not None:
        from sess.engine.runtime.distributed.launch import RANKS_ENV
        from sess.engine.server import rank_agent

        if RANKS_ENV not in os.environ:  # the agent: start the ranks, each runs this command line
            release_start_lock()  # rank 0 writes engine.json; the agent would hold the lock for good
            command = sys.argv[1:] if argv is None else argv
            sys.exit(rank_agent.run_agent(options.nproc, command, options.home, nodes))
        from sess.engine.runtime.distributed.ranks import Ranks

        ranks = Ranks(options.device)
        options = dataclasses.replace(options, device=ranks.device)
        if not ranks.leader:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            rank_agent.follow_rank(options.home, ranks, options.dtype, options.memory_budget)
            sys.exit(0)
    engine_log.configure(sess_home(options.home))
    signal.signal(signal.SIGTERM, _interrupt)  # uvicorn re-raises it after a graceful shutdown
    try:
        serve(options, ranks)
    except KeyboardInterrupt:
        pass
    sys.exit(0)
