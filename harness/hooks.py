"""A run's schedule, as the loop reports its steps: :class:`RunHooks` records every step, evaluates on
held-out data (:mod:`sess.rl.evaluation`) every ``eval_every`` steps, saves state every
``save_every`` steps, and turns a Ctrl-C mid-step into a stop once the step is recorded and saved."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from omegaconf import DictConfig

from sess.engine import TrainingClient
from sess.rl import evaluation
from sess.rl.data import Data
from sess.rl.rollouts import derive_seed

from . import resumes
from .collapse import CollapseWatch, record_warning
from .costs.spend import SpendMeter
from .progress import Progress
from .records import Logger, RunRecord
from .registry import Loop


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
        if cfg.eval_every and done % cfg.eval_every == 0 and done < self.loop_cfg.steps:
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
