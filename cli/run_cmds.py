"""``sess run``: compose a config with Hydra and run a loop on an engine, recording the run."""

from __future__ import annotations

from pathlib import Path

import typer

from sess.cli.app import app, err, fail, guard, report
from sess.cli.output import out


def _help_with_options(ctx: typer.Context, value: bool) -> None:
    """``--help``, followed by the config groups and their options (read from the config itself,
    only when asked, so ``sess --help`` stays fast)."""
    if not value or ctx.resilient_parsing:
        return
    from sess.harness import config

    out.print(ctx.get_help(), highlight=False, markup=False)
    out.print("\nConfig groups (choose with group=option; default first):", highlight=False)
    defaults = {
        "engine": "local",
        "model": "smollm2-135m",
        "loop": "grpo",
        "data": "arithmetic",
        "logger": "local",
    }
    for group in config.GROUPS:
        options = config.group_options(group)
        options.sort(key=lambda name: name != defaults.get(group))
        out.print(f"  {group:<7} {', '.join(options)}", highlight=False, markup=False)
    out.print(
        "\nAny key of a group is set with group.key=value (loop.steps=5, data.max_value=50); "
        "--print-config shows them all.",
        highlight=False,
    )
    raise typer.Exit()


@app.command(context_settings={"allow_extra_args": False, "help_option_names": []})
def run(
    overrides: list[str] = typer.Argument(
        None, help="Hydra overrides: loop=sft model=tiny-llama loop.steps=2 (the groups are listed below)."
    ),
    print_config: bool = typer.Option(False, "--print-config", help="Print the resolved config and exit."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the plan; load no weights, start nothing."),
    pilot: int = typer.Option(
        0,
        "--pilot",
        metavar="N",
        help="With --dry-run: sample N of the run's prompts on the live model (no training) to give the "
        "expected tokens and cost beside the bound; says first what it will load and cost. A step's "
        "batch of prompts (e.g. 8) measures the share of groups that train far better than 1.",
    ),
    resume: Path = typer.Option(
        None,
        "--resume",
        help="Continue RUN_DIR from its newest whole state: its own last save, or the state the engine "
        "saved of its session on shutdown when that is newer.",
    ),
    session: str = typer.Option(None, "--session", help="Session name (reused when it is live)."),
    _help: bool = typer.Option(
        False,
        "--help",
        is_eager=True,
        expose_value=False,
        callback=_help_with_options,
        help="Show this and exit.",
    ),
) -> None:
    """Run a post-training loop: GRPO on smollm2-135m with arithmetic problems unless overridden.

    Writes runs/<time>-<loop>-<model>/ (resolved config, metrics, checkpoints, usage); `sess runs`
    lists them and `sess runs show RUN` charts one. The local engine it uses (started if none runs)
    keeps running afterwards unless engine.keep=false; the run ends by saying which. Ctrl-C or SIGTERM
    finishes the current step, saves it and stops the session (again: at once); --resume RUN_DIR
    continues."""
    from sess.harness import config, runner

    overrides = list(overrides or [])
    if print_config and dry_run:  # each prints instead of running; together one would hide the other
        fail("--print-config and --dry-run: give one (the resolved config, or the plan)", code=2)
    if pilot and not dry_run:
        fail("--pilot goes with --dry-run: it measures what the run will use, before it runs", code=2)
    if pilot < 0:
        fail(f"--pilot: expected a number of prompts >= 1, got {pilot}", code=2)
    if resume is not None:
        if overrides or session or print_config or dry_run:
            fail(
                "--resume replays the recorded config; drop the overrides and other options (or start a new run)"
            )
        cfg = guard(config.load, resume / "config.yaml") if (resume / "config.yaml").is_file() else None
        try:
            path = _run_and_note(cfg, runner.resume, resume)
        except runner.AlreadyCompleted as done:  # exit 0: a retried resume of a finished run succeeded
            out.print(str(done), highlight=False, markup=False, soft_wrap=True)
            return
        out.print(f"resumed and finished: {path}", highlight=False)
        return
    if session is not None:
        overrides.append(f"session={session}")
    cfg = guard(config.compose, overrides)
    if print_config:
        out.print(config.to_yaml(cfg), end="", highlight=False, markup=False)
        return
    if dry_run:
        from sess.harness.costs.dry_run import plan as dry_run_plan

        plan = dry_run_plan(cfg)
        plan["model"] += _source(cfg.model.base_model)
        from sess.cli.forecast_lines import forecast_lines

        for key, value in plan.items():
            out.print(f"{key:>7}: {value}", highlight=False, markup=False)
        was_running = pilot and runner.local_engine(cfg) is not None

        def notify(text: str) -> None:
            out.print(text, highlight=False, markup=False, soft_wrap=True)

        for key, value in guard(forecast_lines, cfg, pilot, notify).items():
            out.print(f"{key:>7}: {value}", highlight=False, markup=False, soft_wrap=True)
        if pilot:
            _engine_note(cfg, was_running)
        return
    path = _run_and_note(cfg, runner.start, overrides)
    out.print(f"run finished: {path}", highlight=False)
    from sess.cli.runs_seeds import summary_line

    if line := summary_line(path):
        out.print(line, highlight=False, markup=False)


def _run_and_note(cfg, work, *args) -> Path:
    """``work(*args)``, then what became of the engine; an error is one red line (before the note),
    Ctrl-C the line that says how to resume (exit 130)."""
    import os

    from sess.engine.sdk.http_transport import EngineUnavailable
    from sess.harness import runner

    was_running = cfg is not None and runner.local_engine(cfg) is not None
    try:
        path = work(*args)
    except runner.Interrupted as stopped:
        _engine_note(cfg, was_running)
        err.print(str(stopped), highlight=False, markup=False)
        raise typer.Exit(130) from None
    except (typer.Exit, KeyboardInterrupt, runner.AlreadyCompleted):
        raise
    except Exception as exc:
        if os.environ.get("SESS_DEBUG"):
            raise
        report(str(exc) or type(exc).__name__)
        _engine_note(cfg, was_running, reached=not isinstance(exc, EngineUnavailable))
        raise typer.Exit(1) from None
    _engine_note(cfg, was_running)
    return path


def _source(base_model: str) -> str:
    """Where the engine would take the model from (catalog knowledge: needs the engine install)."""
    try:
        from sess.engine.runtime.models.catalog import resolve

        spec = resolve(base_model)
    except Exception:
        return ""
    return f" ({spec.source}{': ' + spec.repo if spec.repo else ''})"


def _engine_note(cfg, was_running: bool, reached: bool = True) -> None:
    from sess.harness import runner

    try:
        note = runner.engine_note(cfg, was_running, reached) if cfg is not None else ""
    except Exception:  # a note about the engine must not hide the run's own outcome
        return
    if note:
        out.print(note, highlight=False, markup=False)
