"""``sess run`` (compose a config and run a loop), ``sess runs`` (list run records), ``sess attach``."""

from __future__ import annotations

import os
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from sess.cli.main import app, fail

out = Console()


def _guard(fn, *args, **kwargs):
    """Run ``fn``; an error becomes one red line (``--debug`` / SESS_DEBUG=1 shows the traceback)."""
    try:
        return fn(*args, **kwargs)
    except (typer.Exit, KeyboardInterrupt):
        raise
    except Exception as exc:
        if os.environ.get("SESS_DEBUG"):
            raise
        # One line, unwrapped whatever the terminal width (main.fail would wrap a long message).
        message = " ".join(str(exc).split()) or type(exc).__name__
        Console(stderr=True, soft_wrap=True).print(Text.assemble(("error:", "red"), " ", message))
        raise typer.Exit(1) from None


@app.command(context_settings={"allow_extra_args": False})
def run(
    overrides: list[str] = typer.Argument(
        None, help="Hydra overrides: loop=sft model=tiny-llama loop.steps=2"
    ),
    print_config: bool = typer.Option(False, "--print-config", help="Print the resolved config and exit."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the plan; load no weights, start nothing."),
    resume: Path = typer.Option(None, "--resume", help="Continue RUN_DIR from its last saved state."),
    session: str = typer.Option(None, "--session", help="Session name (reused when it is live)."),
) -> None:
    """Run a post-training loop: GRPO on smollm2-135m with arithmetic problems unless overridden."""
    from sess.loops import config, runner

    overrides = list(overrides or [])
    if resume is not None:
        if overrides:
            fail("--resume replays the recorded config; drop the overrides (or start a new run)")
        path = _guard(runner.resume, resume)
        out.print(f"resumed and finished: {path}")
        return
    if session is not None:
        overrides.append(f"session={session}")
    cfg = _guard(config.compose, overrides)
    if print_config:
        out.print(config.to_yaml(cfg), end="", highlight=False, markup=False)
        return
    if dry_run:
        plan = runner.plan(cfg)
        plan["model"] += _source(cfg.model.base_model)
        for key, value in plan.items():
            out.print(f"{key:>7}: {value}", highlight=False, markup=False)
        return
    path = _guard(runner.start, overrides)
    out.print(f"run finished: {path}")


def _source(base_model: str) -> str:
    try:
        from sess.engine.runtime.catalog import resolve

        spec = resolve(base_model)
    except Exception:
        return ""
    return f" ({spec.source}{': ' + spec.repo if spec.repo else ''})"


@app.command()
def runs(runs_dir: Path = typer.Option(Path("runs"), "--dir", help="Where run records live.")) -> None:
    """List recorded runs."""
    from sess.loops.records import list_runs

    found = list_runs(runs_dir)
    if not found:
        out.print(f"no runs under {runs_dir}")
        return
    header = ("run", "loop", "model", "status", "step", "eval", "session")
    rows = [
        (
            r["run"],
            r["loop"],
            r["model"],
            r["status"],
            f"{r['step']}/{r['steps']}" if r["steps"] else str(r["step"]),
            "" if r["eval"] is None else f"{r['eval']:.3f}",
            r["session"] or "",
        )
        for r in found
    ]
    if not out.is_terminal:  # pipes and scripts get whole names, tab-separated
        for row in [header, *rows]:
            print("\t".join(map(str, row)))
        return
    table = Table(*header)
    for row in rows:
        table.add_row(*map(str, row))
    out.print(table)


BANNER = """sess attach: session {name} on {base_model} ({url})
  tc   TrainingClient of the live session   tc.forward_backward(data), tc.optim_step(AdamParams(...))
  sc   SamplingClient of its current weights sc.sample(tok.encode("..."), 1, SamplingParams(max_tokens=32))
  tok  its tokenizer; svc the ServiceClient; SDK types imported (Datum, ModelInput, TensorData, ...)
Ctrl-D leaves the REPL; the session keeps running."""


@app.command()
def attach(
    name: str = typer.Argument(..., help="A live session's name (see `sess list`)."),
    url: str = typer.Option(None, "--url", help="Engine URL (default: the local engine)."),
    api_key: str = typer.Option(None, "--api-key", help="API key for a remote engine."),
) -> None:
    """Open a Python REPL bound to a live session."""
    import code

    import sess.engine as sdk

    svc = _guard(sdk.ServiceClient, url, api_key)
    tc = _guard(svc.get_training_client, name)
    namespace = {k: getattr(sdk, k) for k in sdk.__all__}
    namespace.update(svc=svc, tc=tc, sc=tc.create_sampling_client(), tok=tc.get_tokenizer())
    code.interact(
        banner=BANNER.format(name=tc.name, base_model=tc.base_model, url=svc.url), local=namespace, exitmsg=""
    )
