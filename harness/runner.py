"""``sess run``: a composed config -> a session on an engine -> a loop's ``train``, with records and evals.

The runner owns everything a loop should not have to think about: it connects to the engine the
config names and creates (or reuses, or restores) the training session (:mod:`.connection`), writes
the run directory, and hands the loop its config (the loop's ``Config`` dataclass, the one place the
run's ``steps`` is read from), the training client, its data and :class:`~.hooks.RunHooks`. It owns
the schedule: through the hooks' ``step_done`` it records every step, evaluates on held-out data at
the start, every ``eval_every`` steps and at the end, and saves state every ``save_every`` steps and at
the end, where the end is the last step the loop reported (SFT's ``epochs`` can end it before its
``steps``). At the end it records usage and stops the session unless ``keep_session``; a failure is
recorded as ``meta.json``'s ``error``. ``python -m sess.harness [overrides]`` comes here too
(:func:`main`).

Ctrl-C mid-step finishes the step, saves it and stops the session (:mod:`.interrupts`).

Seeds: the session's LoRA init uses ``seed``; item k of the data order is a function of (seed, k); the
sampling seed of prompt i at step s is a hash of (seed, s, i). So a replay of a recorded config
reproduces its metrics, and a resume from a state saved at step n continues exactly as the
uninterrupted run would have.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from sess.rl.data import Data
from sess.tasks import sources

from . import config as config_mod
from . import recovery, resumes
from .connection import engine_note, local_engine, open_session, service_client
from .costs.spend import start_spend
from .hooks import RunHooks
from .interrupts import Interrupted, ctrl_c_finishes_the_step, resume_hint, wind_down
from .progress import Progress
from .records import Logger, RunRecord, new_run_dir
from .registry import LOOPS


class RunInterrupted(Exception):
    """Raised by an ``on_step`` callback to stop a run as if it were killed (tests use it)."""


class AlreadyCompleted(ValueError):
    """``resume`` of a run that has finished: there is nothing to continue."""


# ------------------------------------------------------------------------------------------- execute


def start(
    overrides: list[str] | tuple[str, ...] = (),
    *,
    session: str | None = None,
    on_step: Callable[[int], None] | None = None,
    show_progress: bool = True,
) -> Path:
    """Compose, run and record a fresh run; returns its directory."""
    overrides = list(overrides)
    if session is not None:
        overrides.append(f"session={session}")
    cfg = config_mod.compose(overrides)
    loop_cfg = loop_config(cfg)
    data = _load_data(cfg)  # before the run directory: a data error leaves nothing behind
    run_dir = new_run_dir(cfg.runs_dir, cfg.loop.name, cfg.model.name)
    record = RunRecord.create(run_dir, config_mod.to_yaml(cfg), overrides, _meta(cfg, loop_cfg))
    _run(cfg, loop_cfg, data, record, None, on_step=on_step, show_progress=show_progress)
    return run_dir


def resume(
    run_dir: str | Path,
    *,
    on_step: Callable[[int], None] | None = None,
    show_progress: bool = True,
) -> Path:
    """Continue a recorded run from its last saved state, at that step, with the same data order."""
    record = RunRecord(Path(run_dir))
    if not (record.path / "config.yaml").is_file():
        raise ValueError(f"--resume: {run_dir} is not a run directory (no config.yaml)")
    meta = record.meta
    if meta.get("status") == "completed":
        done = max((r["step"] for r in record.metrics() if r.get("kind") == "train"), default=0)
        raise AlreadyCompleted(
            f"run {run_dir} already completed ({done}/{meta.get('steps')} steps); nothing to resume"
        )
    cfg = config_mod.load(record.path / "config.yaml")
    data = _load_data(cfg)
    if record.last_state() is None and not record.rows(resumes.STEPS_FILE):
        raise ValueError(
            f"--resume: {run_dir} has no saved state to resume from (checkpoints.jsonl is empty)"
        )
    resume = resumes.Resume("sess run --resume")
    _run(cfg, loop_config(cfg), data, record, resume, on_step=on_step, show_progress=show_progress)
    return record.path


def loop_config(cfg: DictConfig) -> Any:
    """The loop's own ``Config`` dataclass, from the config's ``loop`` group."""
    return LOOPS[cfg.loop.name].config(**OmegaConf.to_container(cfg.loop, resolve=True))


def _run(cfg, loop_cfg, data: Data, record: RunRecord, resume: resumes.Resume | None, **options) -> None:
    """:func:`_execute`, brought back after its engine goes away (:func:`.recovery.run_recovering`)."""

    def execute(resume: resumes.Resume | None) -> None:
        _execute(cfg, loop_cfg, data, record, resume=resume, **options)

    recovery.run_recovering(cfg, record, execute, resume, passes=(RunInterrupted,))


def _meta(cfg: DictConfig, loop_cfg) -> dict:
    return {
        "loop": cfg.loop.name,
        "model": cfg.model.name,
        "steps": loop_cfg.steps,
        "seed": cfg.seed,
        "engine": {"kind": cfg.engine.kind, "url": cfg.engine.url},
    }


def _load_data(cfg: DictConfig) -> Data:
    """The run's data; fails early when it lacks what the loop trains on."""
    data = sources.load(cfg.data, int(cfg.seed), cfg.grader)
    data.need(LOOPS[cfg.loop.name].data, cfg.loop.name)
    return data


def _execute(cfg, loop_cfg, data: Data, record: RunRecord, *, resume, on_step, show_progress):
    svc = tc = logger = hooks = None
    status, error, start_step = "failed", None, 0
    try:
        loop = LOOPS[cfg.loop.name]
        svc = service_client(cfg.engine)
        if resume is not None:  # from the newest whole state (None: from the start)
            tc, start_step = resumes.open_resumed(
                svc, record, resume, lambda path: open_session(svc, cfg, record, path)
            )
        logger = Logger(record, cfg.logger, OmegaConf.to_container(cfg, resolve=True))
        with Progress(cfg, loop_cfg.steps, start_step, enabled=show_progress) as progress:
            # the first time, the engine fetches and converts the model here (about a minute for smollm2)
            with progress.status(f"starting a session on {cfg.model.base_model}"):
                if tc is None:
                    tc = open_session(svc, cfg, record, None)
            if data.fit is not None:  # prompts sized to the model (data=needle): before anything is drawn
                model = cfg.model.base_model
                window = svc.get_context_windows().get(model)
                data.fit_to(tc.get_tokenizer(), model, window, int(cfg.loop.max_tokens))
            sessions = [*(n for n in record.meta.get("sessions", []) if n != tc.name), tc.name]
            record.update_meta(
                session=tc.name, sessions=sessions, engine={"kind": cfg.engine.kind, "url": svc.url}
            )
            hooks = RunHooks(
                cfg,
                loop,
                loop_cfg,
                tc,
                data,
                record,
                logger,
                progress,
                on_step,
                start_spend(cfg, svc, tc, data, record, start_step),
                done=start_step,
                last_saved=start_step,
            )
            if start_step == 0:
                hooks.evaluate(0)
            if start_step < loop_cfg.steps:
                dataset = data.need(loop.data, cfg.loop.name)
                hooks.mid_step = True  # until the loop's first step_done, and in each step after
                with ctrl_c_finishes_the_step(hooks):
                    loop.train(loop_cfg, tc, dataset, hooks, seed=int(cfg.seed), start_step=start_step)
                hooks.mid_step = False
            # the end is the last step the loop reported: SFT's epochs can stop it before its steps
            final = hooks.done
            if hooks.last_evaluated != final:
                hooks.evaluate(final)
            if hooks.last_saved != final:
                hooks.save(final)
        path = tc.save_weights_for_sampler(name="final").result().path
        record.append("checkpoints.jsonl", {"step": final, "kind": "sampler", "path": path})
        status = "completed"
    except RunInterrupted:
        status = "interrupted"
        raise
    except KeyboardInterrupt:
        status = "interrupted"
        undone = wind_down(svc, tc, hooks, record, keep_session=cfg.keep_session)
        raise Interrupted(resume_hint(record, undone)) from None
    except Exception as exc:
        error = " ".join((str(exc) or type(exc).__name__).split())
        raise
    finally:
        if logger is not None:
            logger.close(status)
        if tc is not None and status != "interrupted":
            try:
                record.write_usage(recovery.run_usage(svc, record).to_wire())
            except Exception:  # usage is a record, not a reason to hide the run's own error
                pass
            if not cfg.keep_session:
                try:
                    tc.stop()
                except Exception:
                    pass
        meta = {k: v for k, v in record.meta.items() if k != "error"}
        record.write_meta(
            {**meta, "status": status, "finished": time.strftime("%Y-%m-%dT%H:%M:%S")}
            | ({"error": error} if error else {})
        )
        if svc is not None and cfg.engine.kind != "inprocess":
            svc.close()


def main(argv: list[str] | None = None) -> None:
    """``python -m sess.harness [overrides]``: the run ``sess run [overrides]`` makes, without the CLI."""
    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in argv):
        print(
            "usage: python -m sess.harness [Hydra overrides, as for sess run: loop=grpo model=tiny-llama loop.steps=2]"
        )
        return
    try:
        cfg = config_mod.compose(argv)
        was_running = local_engine(cfg) is not None
        path = start(argv)
    except Interrupted as stopped:
        print(stopped, file=sys.stderr)
        sys.exit(130)
    except Exception as exc:  # as `sess run` prints it; SESS_DEBUG=1 shows the traceback
        if os.environ.get("SESS_DEBUG"):
            raise
        sys.exit(f"error: {str(exc) or type(exc).__name__}")
    print(f"run finished: {path}")
    note = engine_note(cfg, was_running)
    if note:
        print(note)
