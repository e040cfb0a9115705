"""``sess run``: compose a config with Hydra and run a loop on an engine, recording the run."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console

from sess.cli.main import app, fail, guard

out = Console()


def _help_with_options(ctx: typer.Context, value: bool) -> None:
    """``--help``, followed by the config groups and their options (read from the config itself,
    only when asked, so ``sess --help`` stays fast)."""
    if not value or ctx.resilient_parsing:
        return
    from sess.loops import config

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
    resume: Path = typer.Option(None, "--resume", help="Continue RUN_DIR from its last saved state."),
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
    keeps running afterwards unless engine.keep=false; the run ends by saying which."""
    from sess.loops import config, runner

    overrides = list(overrides or [])
    if resume is not None:
        if overrides:
            fail("--resume replays the recorded config; drop the overrides (or start a new run)")
        cfg = guard(config.load, resume / "config.yaml") if (resume / "config.yaml").is_file() else None
        was_running = cfg is not None and runner.local_engine(cfg) is not None
        path = guard(runner.resume, resume)
        out.print(f"resumed and finished: {path}")
        _engine_note(cfg, was_running)
        return
    if session is not None:
        overrides.append(f"session={session}")
    cfg = guard(config.compose, overrides)
    if print_config:
        out.print(config.to_yaml(cfg), end="", highlight=False, markup=False)
        return
    if dry_run:
        plan = runner.plan(cfg)
        plan["model"] += _source(cfg.model.base_model)
        for key, value in plan.items():
            out.print(f"{key:>7}: {value}", highlight=False, markup=False)
        return
    was_running = runner.local_engine(cfg) is not None
    try:
        path = guard(runner.start, overrides)
        out.print(f"run finished: {path}")
    finally:
        _engine_note(cfg, was_running)


def _source(base_model: str) -> str:
    """Where the engine would take the model from (catalog knowledge: needs the engine install)."""
    try:
        from sess.engine.runtime.catalog import resolve

        spec = resolve(base_model)
    except Exception:
        return ""
    return f" ({spec.source}{': ' + spec.repo if spec.repo else ''})"


def _engine_note(cfg, was_running: bool) -> None:
    from sess.loops import runner

    try:
        note = runner.engine_note(cfg, was_running) if cfg is not None else ""
    except Exception:  # a note about the engine must not hide the run's own outcome
        return
    if note:
        out.print(note, highlight=False, markup=False)
