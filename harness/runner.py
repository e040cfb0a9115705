"""``sess run``: a composed config -> a session on an engine -> a loop's ``train``, with records and evals.

The runner owns everything a loop should not have to think about: it connects to the engine the
config names, creates (or reuses, or restores) the training session, writes the run directory, and
hands the loop its config (the loop's ``Config`` dataclass), the training client, its data and
:class:`RunHooks`. It owns the schedule: through the hooks' ``step_done`` it records every step,
evaluates on held-out data (:mod:`sess.rl.evaluation`) at the start, every ``eval_every`` steps and at
the end, and saves state every ``save_every`` steps and at the end, where the end is the step the
loop's ``train`` says it reached (SFT's ``epochs`` can end it before ``loop.steps``). At the end it records usage and stops the session
unless ``keep_session``; a failure is recorded as ``meta.json``'s ``error``. ``python -m
sess.harness [overrides]`` comes here too (:func:`main`).

Ctrl-C mid-step finishes the step, saves it and stops the session (:mod:`.interrupts`).

Seeds: the session's LoRA init uses ``seed``; item k of the data order is a function of (seed, k); the
sampling seed of prompt i at step s is a hash of (seed, s, i). So a replay of a recorded config
reproduces its metrics, and a resume from a state saved at step n continues exactly as the
uninterrupted run would have.
"""

from __future__ import annotations

import os
import secrets
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from sess.engine import ServiceClient, TrainingClient
from sess.engine.sdk.local_engine import engine_info, memory_text, stop_engine
from sess.rl import evaluation
from sess.rl.data import Data
from sess.rl.rollouts import derive_seed
from sess.tasks import sources

from . import config as config_mod
from . import recovery, resumes
from .collapse import CollapseWatch, record_warning
from .costs.spend import SpendMeter, start_spend
from .interrupts import Interrupted, ctrl_c_finishes_the_step, resume_hint, wind_down
from .progress import Progress
from .records import Logger, RunRecord, new_run_dir
from .registry import LOOPS, Loop


class RunInterrupted(Exception):
    """Raised by an ``on_step`` callback to stop a run as if it were killed (tests use it)."""


class AlreadyCompleted(ValueError):
    """``resume`` of a run that has finished: there is nothing to continue."""


def service_client(engine_cfg) -> ServiceClient:
    if engine_cfg.kind == "inprocess":
        return ServiceClient("inproc")
    if engine_cfg.kind == "remote":
        return ServiceClient(engine_cfg.url, engine_cfg.api_key)
    return ServiceClient()  # local: the engine of SESS_HOME


def local_engine(cfg: DictConfig) -> dict | None:
    """The running local engine a run with ``cfg`` uses ({url, pid, rss_bytes, ...}), if any."""
    if cfg.engine.kind != "local" or os.environ.get("SESS_ENGINE_URL"):
        return None
    return engine_info()


def engine_note(cfg: DictConfig, was_running: bool, reached: bool = True) -> str:
    """What a finished run says about the engine it used: still running (and its memory, and how to
    stop it), or stopped because this run started it and ``engine.keep`` is false. Of a remote engine
    the run could not reach (``reached`` false) it says nothing: it does not know."""
    if cfg.engine.kind == "inprocess":
        return ""
    if cfg.engine.kind == "remote" or os.environ.get("SESS_ENGINE_URL"):
        if not reached:
            return ""
        return f"the engine at {cfg.engine.url or os.environ.get('SESS_ENGINE_URL')} keeps running"
    info = engine_info()
    if info is None:
        return "the local engine is not running"
    if not was_running and not cfg.engine.keep:
        stop_engine()
        return f"stopped the local engine this run started (pid {info['pid']}; engine.keep=false)"
    memory = f"; {memory_text(info)}" if info.get("rss_bytes") else ""
    return (
        f"the local engine {info['url']} (pid {info['pid']}) is still running{memory}; the next run "
        f"reuses it. It stops sessions idle for {info['idle_timeout']:.0f} s but keeps the process: "
        "stop it with `sess engine down`, or run with engine.keep=false"
    )


@dataclass
class RunHooks:
    """The runner's :class:`~sess.rl.hooks.Hooks`: a step is logged, then evaluated and saved when due."""

    cfg: DictConfig
    loop: Loop
    loop_cfg: Any  # the loop's own Config dataclass
    tc: TrainingClient
    data: Data
    record: RunRecord
    logger: Logger
    progress: Progress
    on_step: Callable[[int], None] | None = None
    spend: SpendMeter | None = None  # spend so far and projected, in each step's row
    done: int = 0  # steps done (the step a run starts at, until its first step_done)
    last_saved: int = 0  # the step of the newest saved state (the start step's state exists already)
    last_evaluated: int = -1  # the step of the newest evaluation
    mid_step: bool = False  # the loop is inside a step: its updates may be partly applied
    stop_requested: bool = False  # Ctrl-C came mid-step: stop once this step is recorded and saved
    watch: CollapseWatch = field(default_factory=CollapseWatch)  # entropy floor, accuracy drop

    def step_done(self, step: int, metrics: dict) -> None:
        self.mid_step = False
        done = self.done = step + 1
        row = {"kind": "train", "step": done, **{k: _plain(v) for k, v in metrics.items()}}
        if self.spend is not None:
            row.update(self.spend.step_done(done, row))
        record_warning(self.record, self.progress, row, self.watch.after_step(done, row))
        self.logger.log(row)
        resumes.note_step(self.record, self.tc, done)
        self.progress.update(done, row)
        cfg = self.cfg
        if cfg.eval_every and done % cfg.eval_every == 0 and done < cfg.loop.steps:
            self.evaluate(done)
        if cfg.save_every and done % cfg.save_every == 0:
            self.save(done)
        if self.on_step is not None:
            self.on_step(done)
        if self.stop_requested:
            raise KeyboardInterrupt
        self.mid_step = True

    def on_ctrl_c(self, signum, frame) -> None:
        """SIGINT or SIGTERM while the loop trains: finish the step first; a second one (or one
        between steps) is a KeyboardInterrupt."""
        if not self.mid_step or self.stop_requested:
            raise KeyboardInterrupt
        self.stop_requested = True
        self.progress.note(f"stopping after step {self.done + 1} to save it; Ctrl-C again to stop without it")

    def evaluate(self, done: int) -> dict:
        with self.progress.status(f"evaluating at step {done}"):
            metrics = SpendMeter.measure(self.spend, self._evaluate, done)
        record_warning(self.record, self.progress, metrics, self.watch.after_eval(done, metrics))
        self.logger.log({"kind": "eval", "step": done, **metrics})
        self.progress.note_eval(done, metrics)
        self.last_evaluated = done
        return metrics

    def _evaluate(self, done: int) -> dict:
        started = time.perf_counter()
        metrics: dict[str, float] = {}
        if self.data.envs is not None:
            turns = (
                self.loop_cfg.max_turns if self.loop.data == "envs" else None
            )  # the loop's cap, if an RL loop
            metrics.update(env_evaluation(self.cfg, self.tc, self.data.envs.held_out, done, turns))
        elif self.data.chats is not None:
            metrics.update(evaluation.chat_loss(self.tc, self.data.chats.held_out))
        if self.loop.evaluate is not None:
            metrics.update(self.loop.evaluate(self.tc, self.data.need(self.loop.data, self.cfg.loop.name)))
        metrics["eval/seconds"] = time.perf_counter() - started
        return metrics

    def save(self, done: int) -> str:
        """Save state at step ``done``; the record keeps the session's usage then, so a resume knows
        what the work after it cost (what a crash loses, at most ``save_every`` steps)."""
        path = self.tc.save_state(name=f"step{done:06d}").result().path
        usage = self.tc.service.get_usage(self.tc.name).to_wire()
        self.record.append("checkpoints.jsonl", {"step": done, "kind": "state", "path": path, "usage": usage})
        self.last_saved = done
        return path


def env_evaluation(cfg: DictConfig, tc: TrainingClient, envs: list, done: int, turns: int | None) -> dict:
    """The held-out episodes of a run of ``cfg`` after ``done`` steps, at most ``turns`` replies each:
    greedy, and ``eval_samples`` sampled answers a problem at the loop's temperature when set
    (:mod:`sess.rl.evaluation`)."""
    loop, cap = cfg.loop, cfg.loop.get("max_observation_tokens")  # None: the rollouts' default
    seeds = [derive_seed(cfg.seed, "sample", done, i) for i in range(len(envs))]
    metrics = evaluation.greedy_episodes(tc, envs, loop.max_tokens, seeds, turns, cap)
    if samples := cfg.eval_samples:
        seeds = [derive_seed(cfg.seed, "eval-sampled", i) for i in range(len(envs))]
        args = (loop.max_tokens, loop.temperature, samples, seeds, turns, cap)
        metrics.update(evaluation.sampled_episodes(tc, envs, *args))
    return metrics


def _plain(value: Any) -> Any:
    return float(value) if hasattr(value, "__float__") and not isinstance(value, bool | int) else value


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
    data = _load_data(cfg)  # before the run directory: a data error leaves nothing behind
    run_dir = new_run_dir(cfg.runs_dir, cfg.loop.name, cfg.model.name)
    record = RunRecord.create(run_dir, config_mod.to_yaml(cfg), overrides, _meta(cfg))
    _run(cfg, data, record, None, on_step=on_step, show_progress=show_progress)
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
    _run(cfg, data, record, resumes.Resume("sess run --resume"), on_step=on_step, show_progress=show_progress)
    return record.path


def _run(cfg, data: Data, record: RunRecord, resume: resumes.Resume | None, **options) -> None:
    """:func:`_execute`, brought back after its engine goes away (:func:`.recovery.run_recovering`)."""

    def execute(resume: resumes.Resume | None) -> None:
        _execute(cfg, data, record, resume=resume, **options)

    recovery.run_recovering(cfg, record, execute, resume, passes=(RunInterrupted,))


def _meta(cfg: DictConfig) -> dict:
    return {
        "loop": cfg.loop.name,
        "model": cfg.model.name,
        "steps": cfg.loop.steps,
        "seed": cfg.seed,
        "engine": {"kind": cfg.engine.kind, "url": cfg.engine.url},
    }


def _open_session(svc: ServiceClient, cfg: DictConfig, record: RunRecord, resume_from: str | None):
    # Run folders are unique per runs_dir only; one engine serves many folders, so add a tag.
    tag = secrets.token_hex(2)
    if resume_from is not None:
        name = f"{record.path.name}-r{len(record.meta.get('resumes', []))}-{tag}"
        return svc.create_training_client_from_state_with_optimizer(resume_from, training_session_name=name)
    name = str(cfg.session or f"{record.path.name}-{tag}")
    if cfg.session:
        same = [s for s in svc.list_sessions(name_contains=name) if s.name == name]
        if same and same[0].status.value == "Running":
            return svc.get_training_client(name)
        if same:
            raise ValueError(
                f"session {name!r} is {same[0].status.value}; a run needs a new name or a Running session "
                f"(`sess resume {name}` continues it)"
            )
    lora = cfg.model.lora
    return svc.create_lora_training_client(
        cfg.model.base_model,
        rank=lora.rank,
        alpha=lora.alpha,
        training_session_name=name,
        seed=int(cfg.seed),
        train_attn=lora.train_attn,
        train_mlp=lora.train_mlp,
        train_unembed=lora.train_unembed,
        user_metadata={"run_dir": str(record.path)},
    )


def _load_data(cfg: DictConfig) -> Data:
    """The run's data; fails early when it lacks what the loop trains on."""
    data = sources.load(cfg.data, int(cfg.seed), cfg.grader)
    data.need(LOOPS[cfg.loop.name].data, cfg.loop.name)
    return data


def _execute(cfg, data: Data, record: RunRecord, *, resume, on_step, show_progress):
    svc = tc = logger = hooks = None
    status, error, start_step = "failed", None, 0
    try:
        loop = LOOPS[cfg.loop.name]
        loop_cfg = loop.config(**OmegaConf.to_container(cfg.loop, resolve=True))  # the loop's own dataclass
        svc = service_client(cfg.engine)
        if resume is not None:  # from the newest whole state (None: from the start)
            tc, start_step = resumes.open_resumed(
                svc, record, resume, lambda path: _open_session(svc, cfg, record, path)
            )
        logger = Logger(record, cfg.logger, OmegaConf.to_container(cfg, resolve=True))
        with Progress(cfg, start_step, enabled=show_progress) as progress:
            # the first time, the engine fetches and converts the model here (about a minute for smollm2)
            with progress.status(f"starting a session on {cfg.model.base_model}"):
                if tc is None:
                    tc = _open_session(svc, cfg, record, None)
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
            final = start_step
            if start_step < loop_cfg.steps:
                dataset = data.need(loop.data, cfg.loop.name)
                hooks.mid_step = True  # until the loop's first step_done, and in each step after
                with ctrl_c_finishes_the_step(hooks):
                    final = loop.train(
                        loop_cfg, tc, dataset, hooks, seed=int(cfg.seed), start_step=start_step
                    )
                hooks.mid_step = False
            # the end is the step the loop reached: SFT's epochs can stop it before loop.steps
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
