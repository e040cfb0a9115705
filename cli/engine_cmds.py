"""``sess engine up|status|down|keys``: run and inspect the engine of an engine home."""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
import typing
from pathlib import Path

import typer

from sess.cli.app import app, fail
from sess.cli.output import out
from sess.engine.server import registry_guard
from sess.engine.server.options import EngineOptions

engine_app = typer.Typer(help="Run, inspect and stop the engine; manage its API keys.", no_args_is_help=True)
keys_app = typer.Typer(help="API keys of the engine home.", no_args_is_help=True)
engine_app.add_typer(keys_app, name="keys")
app.add_typer(engine_app, name="engine")

HOME = typer.Option(None, "--home", help=EngineOptions.help("home"))
NODE_OPTIONS = ("nnodes", "node_rank", "master", "join_timeout")  # what another host's agent is given


def _with_engine_options(command):
    """``command(ctx, detach, **options)`` given one option per field of :class:`EngineOptions`: its
    flag, default and help, as ``python -m sess.engine.server`` takes them."""
    hints = typing.get_type_hints(EngineOptions)
    fixed = [p for p in inspect.signature(command).parameters.values() if p.kind != p.VAR_KEYWORD]
    generated = [
        inspect.Parameter(
            f.name,
            inspect.Parameter.KEYWORD_ONLY,
            annotation=hints[f.name],
            default=typer.Option(f.default, EngineOptions.flag(f.name), help=f.metadata["help"]),
        )
        for f in dataclasses.fields(EngineOptions)
    ]
    command.__signature__ = inspect.Signature([*fixed, *generated])
    return command


@engine_app.command("up")
@_with_engine_options
def up(
    ctx: typer.Context,
    detach: bool = typer.Option(False, "--detach", help="Start in the background and return."),
    **given,
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
    from sess.engine.server.listen import bind
    from sess.engine.server.serve import START_LOCK_FD_ENV

    options = EngineOptions(**given)
    home_path = sess_home(options.home)
    problem = options.check()
    if problem:
        fail(problem)
    host, port, device = options.host, options.port, options.device
    nodes = options.nodes()
    if nodes is not None and nodes.rank != 0:  # no server here: node 0's engine.json names the engine
        from sess.engine.server.rank_agent import start_node

        extra = ["--nproc", str(options.nproc), *options.argv(only=NODE_OPTIONS)]
        out.print(start_node(home_path, host, port, device, extra, detach))
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
        extra = options.argv(skip=("home", "host", "port", "device"))  # server_command gives those
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

    if (
        options.nproc != 1 or nodes is not None
    ):  # the elastic agent starts the ranks: engine/server/rank_agent.py
        from sess.engine.server.rank_agent import run_agent

        release_start_lock()
        raise typer.Exit(run_agent(options.nproc, command[3:], home_path, nodes))
    try:
        serve(options)
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
