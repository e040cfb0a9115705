"""``sess engine up|status|down|keys``: run and inspect the engine of an engine home."""

from __future__ import annotations

import json
import os
from pathlib import Path

import typer

from sess.cli.app import app, fail
from sess.cli.output import out
from sess.engine.server import registry_guard, settings

engine_app = typer.Typer(help="Run, inspect and stop the engine; manage its API keys.", no_args_is_help=True)
keys_app = typer.Typer(help="API keys of the engine home.", no_args_is_help=True)
engine_app.add_typer(keys_app, name="keys")
app.add_typer(engine_app, name="engine")

HOME = typer.Option(None, "--home", help="Engine home (default $SESS_HOME or ~/.sess).")


@engine_app.command("up")
def up(
    ctx: typer.Context,
    host: str = typer.Option("127.0.0.1", help="Address to bind; non-loopback needs API keys."),
    port: int = typer.Option(0, help="Port (0: a free one, recorded in HOME/engine.json)."),
    home: str = HOME,
    device: str = typer.Option("cpu", help="cpu or cuda."),
    detach: bool = typer.Option(False, "--detach", help="Start in the background and return."),
    idle_timeout: float = typer.Option(
        settings.IDLE_TIMEOUT_S,
        help="Seconds a session may go without an op or a client heartbeat; then its state is saved "
        "and it is stopped (sess resume NAME continues it).",
    ),
    max_sessions: int = typer.Option(settings.MAX_SESSIONS, help="Live sessions per API key (at least 1)."),
    tls_cert: str = typer.Option(
        None, "--tls-cert", help="PEM certificate (chain) to serve https with; needs --tls-key."
    ),
    tls_key: str = typer.Option(None, "--tls-key", help="PEM private key of --tls-cert."),
    dtype: str = typer.Option(
        None,
        help="Precision of the base models' weights: float32 or bfloat16 (default: float32 on cpu, "
        "bfloat16 on cuda); per model with MODEL=DTYPE, e.g. float32,gpt-oss-20b=bfloat16. LoRA "
        "weights and optimizer state stay float32.",
    ),
    memory_budget: str = typer.Option(
        None,
        help="Memory a training op may hold for activations and output-layer logits, e.g. 1G "
        "(default: 384M on cpu, half the free device memory on cuda); the logits, in chunks, take a "
        "quarter of it. Bigger batches run in micro-batches, a datum that needs more runs with "
        "activation checkpointing (without a budget given, within a quarter of the memory available), "
        "and one too long even then is refused. On cpu the sampler keeps "
        "prepacked copies of the base weights (faster decode steps, as many bytes as the weights) "
        "only where they fit in it; without it, where they take at most a quarter of the free memory.",
    ),
    nproc: int = typer.Option(
        1,
        help="Ranks (torch.distributed: gloo on cpu, NCCL on cuda), one per CPU core or GPU at most: "
        "base models are sharded with FSDP2 and each rank trains on a share of every batch.",
    ),
    prices: str = typer.Option(
        None,
        help="YAML price table (currency:, models: with prefill/sampled/trained, optionally cached_prefill, per million tokens; "
        "see conf/prices.example.yaml): usage then shows cost, and key budgets are in its currency.",
    ),
    max_queued: int = typer.Option(
        settings.MAX_QUEUED,
        help="Ops one API key may have queued or running; past it a submit gets 429 and Retry-After "
        "(the SDKs wait and retry).",
    ),
    queue: str = typer.Option(
        "fair", help="Order of ops across keys: fair (fair share of engine time) or arrival."
    ),
    sampler: str = typer.Option(
        "builtin",
        help="builtin (bit-exact, batch-invariant; the default) or vllm: sample requests go to vLLM, "
        "which loads each base model once and each sampler version's LoRA from its PEFT files; "
        "a live session's current weights are exported for it when they changed.",
    ),
    sampler_python: str = typer.Option(
        None,
        "--sampler-python",
        help="With --sampler vllm: the Python of an environment that has vLLM (it pins its own torch "
        "and transformers; default: this Python).",
    ),
    sampler_max_lora_rank: int = typer.Option(
        32, help="With --sampler vllm: the largest LoRA rank vLLM serves (sessions above it are refused)."
    ),
    nnodes: int = typer.Option(
        1,
        help="Hosts of one engine, each running --nproc ranks (run `sess engine up` on each, with "
        "the same --nnodes and --master, the same --home on a shared filesystem, and its own "
        "--node-rank); node 0's first rank serves.",
    ),
    node_rank: int = typer.Option(0, help="This host's place among --nnodes hosts: 0 to --nnodes - 1."),
    master: str = typer.Option(
        None, help="HOST:PORT of node 0, where the hosts meet (torch.distributed's rendezvous)."
    ),
    join_timeout: float = typer.Option(
        300.0, help="Seconds node 0 waits for every host to join (and another host for node 0)."
    ),
) -> None:
    """Start the engine server (in the foreground unless --detach).

    It serves sess's SDK (/api), the OpenAI routes (/v1) and the Tinker protocol (/api/v1) that
    the unmodified tinker SDK and tinker-cookbook speak. For an engine other machines reach, bind
    --host 0.0.0.0, add keys (sess engine keys add) and serve https with --tls-cert/--tls-key;
    clients then trust the certificate through SESS_CA_BUNDLE (sess) or SSL_CERT_FILE (tinker).

    With the home's engine already running, it says where and exits 0, or exits 1 naming the
    options given here that the running engine does not have.

    A CPU engine runs on glibc's malloc, tuned to keep freed memory for the next step;
    SESS_MALLOC=jemalloc runs it on the system's jemalloc (leaner; Debian: libjemalloc2) and
    SESS_MALLOC=system on glibc's defaults."""
    from sess.engine.protocol.home import sess_home
    from sess.engine.runtime.memory.malloc_tuning import exec_as_engine
    from sess.engine.sdk.local_engine import acquire_start_lock, engine_info, server_command, start_engine
    from sess.engine.server.keys import KeyStore
    from sess.engine.server.serve import START_LOCK_FD_ENV
    from sess.engine.server.serve_checks import bind, check_options, check_tls, is_loopback

    home_path = sess_home(home)
    try:
        check_tls(tls_cert, tls_key)
    except SystemExit as exc:
        fail(str(exc))
    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        fail(f"--device: expected cpu or cuda, got {device!r}")
    if queue not in ("fair", "arrival"):
        fail(f"--queue: expected fair or arrival, got {queue!r}")
    problem = check_options(
        device,
        dtype,
        memory_budget,
        port=port,
        idle_timeout=idle_timeout,
        max_sessions=max_sessions,
        prices=prices,
        max_queued=max_queued,
    )
    if problem:
        fail(problem)
    if not is_loopback(host) and not KeyStore(home_path).load():
        fail(
            f"refusing to listen on {host} without API keys; add one first: sess engine keys add --home {home_path}"
        )
    from sess.engine.runtime.distributed.launch import check_nproc
    from sess.engine.runtime.distributed.nodes import Nodes

    try:
        check_nproc(nproc, device)
        nodes = Nodes.parse(nnodes, node_rank, master, join_timeout)
    except ValueError as exc:
        fail(str(exc))
    from sess.engine.runtime.vllm.sampler import check_sampler

    problem = check_sampler(sampler, sampler_python, nproc, sampler_max_lora_rank)
    if problem:
        fail(problem)
    node_args = []
    if nodes is not None:
        node_args = ["--nnodes", str(nnodes), "--node-rank", str(node_rank), "--master", master]
        node_args += ["--join-timeout", str(join_timeout)]
    if nodes is not None and nodes.rank != 0:  # no server here: node 0's engine.json names the engine
        from sess.engine.server.serve_ranks import start_node

        out.print(start_node(home_path, host, port, device, ["--nproc", str(nproc), *node_args], detach))
        return
    # The lock ensure_local_engine takes: of two starts at once, the second finds the first's engine.
    lock, handed_down = acquire_start_lock(home_path), False
    try:
        running = engine_info(home_path)
        if running is not None:
            differing = _differing_options(ctx, running)
            where = f"at {running['url']} (pid {running['pid']})"
            if differing:
                fail(
                    f"an engine already runs for home {home_path} {where} with other options: "
                    f"{', '.join(differing)}; stop it first (sess engine down) to start one with these"
                )
            out.print(f"engine already running {where}")
            return
        if port:  # a busy port: one line now, not a failed start
            try:
                bind(host, port).close()
            except SystemExit as exc:
                fail(str(exc))
        lost = registry_guard.problem(home_path)  # the engine checks it too; this says it at once
        if lost:
            fail(lost)
        extra = ["--idle-timeout", str(idle_timeout), "--max-sessions", str(max_sessions)]
        extra += ["--dtype", dtype] if dtype else []
        extra += ["--memory-budget", memory_budget] if memory_budget else []
        extra += ["--prices", str(Path(prices).resolve())] if prices else []
        extra += ["--max-queued", str(max_queued), "--queue", queue]
        if tls_cert:
            extra += ["--tls-cert", tls_cert, "--tls-key", tls_key]
        if nproc != 1:
            extra += ["--nproc", str(nproc)]
        if sampler != "builtin" or sampler_python:
            extra += ["--sampler", sampler, "--sampler-max-lora-rank", str(sampler_max_lora_rank)]
            extra += ["--sampler-python", sampler_python] if sampler_python else []
        extra += node_args
        if detach:
            info = start_engine(home_path, host=host, port=port, device=device, extra_args=extra)
            out.print(f"engine running at {info['url']} (pid {info['pid']}, home {home_path})")
            return
        # In the foreground this process becomes the engine; it keeps the lock until its
        # engine.json is written (serve.release_start_lock), across the exec below.
        os.set_inheritable(lock, True)
        os.environ[START_LOCK_FD_ENV] = str(lock)
        handed_down = True
    finally:
        if not handed_down:
            os.close(lock)
    command = server_command(home_path, host, port, device, extra)
    exec_as_engine(command, device)  # malloc settings: memory.py
    from sess.engine.server.serve import release_start_lock, serve

    if nproc != 1 or nodes is not None:  # the elastic agent starts the ranks: engine/server/serve_ranks.py
        from sess.engine.server.serve_ranks import run_agent

        release_start_lock()
        raise typer.Exit(run_agent(nproc, command[3:], home_path, nodes))
    try:
        serve(
            home_path,
            host,
            port,
            device,
            idle_timeout,
            max_sessions,
            tls_cert=tls_cert,
            tls_key=tls_key,
            dtype=dtype,
            memory_budget=memory_budget,
            prices=prices,
            max_queued=max_queued,
            fair=queue == "fair",
            sampler=sampler,
            sampler_python=sampler_python,
            sampler_max_lora_rank=sampler_max_lora_rank,
        )
    except SystemExit as exc:
        if not isinstance(exc.code, str):
            raise
        fail(exc.code.removeprefix("sess engine: "))
    finally:
        release_start_lock()  # if serve stopped before it could


def _differing_options(ctx: typer.Context, running: dict) -> list[str]:
    """The options given on this command line that the running engine (its engine.json) lacks, as
    ``--port 18703 (asked 18704)``; options left at their defaults never differ."""
    from sess.engine.runtime.memory.training_budget import parse_bytes
    from sess.engine.runtime.models.catalog import Dtypes, default_dtype

    recorded = running.get("options", {})  # an engine from before options were recorded: none
    device = recorded.get("device", "cpu")

    def dtypes(text):
        parsed = Dtypes.parse(text)
        return parsed.default or default_dtype(device), dict(parsed.per_model)

    def cuda0(name):
        return "cuda:0" if name == "cuda" else name

    same = {
        "host": lambda asked: asked == running.get("host"),
        "port": lambda asked: asked in (0, running.get("port")),
        "device": lambda asked: cuda0(asked) == cuda0(device),
        "idle_timeout": lambda asked: asked == running.get("idle_timeout", recorded.get("idle_timeout")),
        "max_sessions": lambda asked: asked == recorded.get("max_sessions", asked),
        "tls_cert": lambda asked: str(Path(asked).resolve()) == running.get("tls_cert"),
        "dtype": lambda asked: "dtype" not in recorded or dtypes(asked) == dtypes(recorded["dtype"]),
        "memory_budget": lambda asked: (
            "memory_budget" not in recorded
            or parse_bytes(asked) == (recorded["memory_budget"] and parse_bytes(recorded["memory_budget"]))
        ),
        "nproc": lambda asked: asked == recorded.get("nproc", asked),
        "prices": lambda asked: str(Path(asked).resolve()) == recorded.get("prices"),
        "max_queued": lambda asked: asked == recorded.get("max_queued", asked),
        "queue": lambda asked: asked == recorded.get("queue", asked),
        "sampler": lambda asked: asked == recorded.get("sampler", "builtin"),
    }
    differing = []
    for name, matches in same.items():
        asked, source = ctx.params[name], ctx.get_parameter_source(name)
        # by name: typer carries its own copy of click's ParameterSource
        if source is None or source.name in ("DEFAULT", "DEFAULT_MAP") or matches(asked):
            continue
        value = {"port": running.get("port"), "tls_cert": running.get("tls_cert")}.get(
            name, recorded.get(name, running.get(name))
        )
        flag = "--" + name.replace("_", "-")
        differing.append(f"{flag} {'not set' if value is None else value} (asked {asked})")
    return differing


@engine_app.command("status")
def status(
    home: str = HOME,
    as_json: bool = typer.Option(False, "--json", help="As JSON: {running, url, pid, port, ...}."),
) -> None:
    """Show whether the engine of the home is running, and where."""
    from sess.engine.protocol.home import sess_home
    from sess.engine.sdk.local_engine import engine_info, memory_text

    info = engine_info(sess_home(home))
    if info is None:
        if as_json:
            print(json.dumps({"running": False}))
            raise typer.Exit(1)
        fail(f"no engine is running for {sess_home(home)} (start one: sess engine up --detach)")
    if as_json:
        print(json.dumps({"running": True, **info}))
    else:
        memory = f"; {memory_text(info)}" if info.get("rss_bytes") else ""
        out.print(
            f"engine running at {info['url']} (pid {info['pid']}, home {sess_home(home)}{memory}; "
            f"sessions idle {info['idle_timeout']:.0f} s are saved and stopped)",
            highlight=False,
        )
        invariance = info.get("batch_invariant")
        if invariance:
            out.print(
                "sampling: batch-invariant on this CPU (a request's logprobs are the same bits in any batch)"
                if invariance["exact"]
                else "sampling: NOT batch-invariant on this CPU (logprobs may differ in their last bits with "
                f"what shares a batch; replays stay exact): {'; '.join(invariance['inexact'])}"
            )
            if invariance.get("few_rows"):
                out.print(f"one- and two-row matmuls: {invariance['few_rows']}", highlight=False)
            if invariance.get("fused_ops"):
                out.print(f"attention, norms and token draws: {invariance['fused_ops']}", highlight=False)


@engine_app.command("down")
def down(home: str = HOME) -> None:
    """Stop the engine of the home; its live sessions become Interrupted (sess resume NAME).

    A one-rank engine first saves the state of each live session that trained since its last
    save_state (sess://NAME/state/shutdown-step...), so nothing is lost. The ranks of an engine
    started with --nproc N stop together, so their sessions resume from the states saved before."""
    from sess.engine.protocol.home import sess_home
    from sess.engine.sdk.local_engine import stop_engine

    info = stop_engine(sess_home(home))
    if info is None:  # the state asked for already holds: not an error
        out.print(f"no engine is running for {sess_home(home)}; nothing to stop", highlight=False)
        return
    if info.get("killed"):
        fail(
            f"engine at {info['url']} did not stop within {info['killed']:.0f} s and was killed: its live "
            "sessions resume from the states they saved before (sess checkpoints NAME)"
        )
    out.print(f"engine at {info['url']} stopped")


@engine_app.command("repair")
def repair(home: str = HOME) -> None:
    """Rebuild a lost or unreadable registry.db from the manifests beside the checkpoints.

    Sessions (stopped, resumable) and checkpoints come back under their owners; the broken file is
    kept as registry.db.broken-<time>. Usage and spend are not in the manifests: registry.db.bak,
    the backup the engine writes at each start, has them. Run it with the engine down."""
    from sess.engine.protocol.home import sess_home
    from sess.engine.sdk.local_engine import engine_info
    from sess.engine.server.registry_repair import repair as rebuild

    home_path = sess_home(home)
    running = engine_info(home_path)
    if running is not None:
        fail(f"an engine runs for {home_path} at {running['url']}; stop it first (sess engine down)")
    for line in rebuild(home_path):
        out.print(line, highlight=False)
