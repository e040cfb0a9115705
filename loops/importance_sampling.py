"""Off-policy RL: rollout workers sample while the trainer trains; importance weights correct the lag.

``rollout_workers`` threads each take the next problem index k (or a requeued one), sample
``group_size`` completions from the newest published policy, score them (exact final answer 1, wrong
0, unparseable ``-format_penalty``) and hand the group to the trainer, tagged with the policy's step.
At most ``batch_size * (max_steps_off_policy + 1)`` groups are sampled ahead of the trainer. Each
training step takes ``batch_size`` groups; a group sampled by policy step ``v`` at training step ``s``
is used when ``s - v <= max_steps_off_policy``, otherwise ``stale_policy`` says what happens to it:
``requeue`` (resample the same problem from the newest policy) or ``discard``. Advantages are
group-relative (``r_g - mean(r)``), spread over completion tokens and token-mean normalised; the loss
is ``importance_sampling``: ``-(ρ A).sum()`` with ``ρ = exp(logp - logp_sampler)``, whose ratio
corrects for the policy having moved since the group was sampled. After each ``optim_step`` the
trainer publishes a new sampler (``save_weights_and_get_sampling_client``) for the workers.

Which policy version samples a group depends on timing, so unlike grpo this loop is not bit-for-bit
reproducible. Launch: ``sess run loop=importance_sampling loop.max_steps_off_policy=2``.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from dataclasses import dataclass

from sess.engine import AdamParams

from . import grpo, rollouts
from .config import LoopConfig

NEEDS = ("problem",)


@dataclass
class Config(LoopConfig):
    name: str = "importance_sampling"
    group_size: int = 8
    rollout_workers: int = 2
    max_steps_off_policy: int = 1
    stale_policy: str = "requeue"  # requeue | discard
    scale_by_std: bool = False
    format_penalty: float = 0.1


class Rollouts:
    """The worker pool: problem indices in, scored groups (tagged with their policy step) out."""

    def __init__(self, run, first_index: int, sc, policy_step: int):
        cfg = run.loop
        self.run = run
        self.next_index = first_index
        self.requeued: deque[tuple[int, int]] = deque()
        self.policy = (policy_step, sc)
        self.lock = threading.Lock()
        self.out: queue.Queue = queue.Queue()
        self.room = threading.Semaphore(cfg.batch_size * (cfg.max_steps_off_policy + 1))
        self.stopping = threading.Event()
        self.errors: list[BaseException] = []
        self.threads = [
            threading.Thread(target=self._work, name=f"rollout-{i}", daemon=True)
            for i in range(cfg.rollout_workers)
        ]
        for t in self.threads:
            t.start()

    def publish(self, policy_step: int, sc) -> None:
        with self.lock:
            self.policy = (policy_step, sc)

    def requeue(self, k: int, attempt: int) -> None:
        with self.lock:
            self.requeued.append((k, attempt + 1))

    def take(self) -> tuple[int, int, rollouts.Group]:
        while True:
            if self.errors:
                raise self.errors[0]
            try:
                item = self.out.get(timeout=0.5)
            except queue.Empty:
                continue
            self.room.release()
            return item

    def _work(self) -> None:
        run, cfg = self.run, self.run.loop
        while not self.stopping.is_set():
            if not self.room.acquire(timeout=0.2):
                continue
            with self.lock:
                if self.requeued:
                    k, attempt = self.requeued.popleft()
                else:
                    k, attempt = self.next_index, 0
                    self.next_index += 1
                policy_step, sc = self.policy
            try:
                problem = run.data.train_problem(k)
                pending = rollouts.submit_group(run, sc, problem, cfg.group_size, k, attempt)
                group = rollouts.finish_group(run, *pending, policy_step=policy_step)
            except BaseException as exc:  # surfaced to the trainer at its next take()
                self.errors.append(exc)
                return
            self.out.put((k, attempt, group))

    def close(self) -> None:
        self.stopping.set()
        for t in self.threads:
            t.join(timeout=30)


def main(run) -> None:
    cfg = run.loop
    grpo.check(cfg)
    if cfg.stale_policy not in ("requeue", "discard"):
        raise ValueError(f"loop.stale_policy: expected requeue or discard, got {cfg.stale_policy!r}")
    if cfg.rollout_workers < 1 or cfg.max_steps_off_policy < 0:
        raise ValueError("loop.rollout_workers must be >= 1 and loop.max_steps_off_policy >= 0")
    adam = AdamParams(learning_rate=cfg.learning_rate, grad_clip_norm=cfg.grad_clip_norm)
    sc = run.tc.save_weights_and_get_sampling_client()
    pool = Rollouts(run, run.start_step * cfg.batch_size, sc, run.start_step)
    try:
        for step in range(run.start_step, cfg.steps):
            started = time.perf_counter()
            groups_P, stale, lags = [], 0, []
            while len(groups_P) < cfg.batch_size:
                k, attempt, group = pool.take()
                lag = step - group.policy_step
                if lag > cfg.max_steps_off_policy:
                    stale += 1
                    if cfg.stale_policy == "requeue":
                        pool.requeue(k, attempt)
                    continue
                groups_P.append(group)
                lags.append(lag)
            metrics = rollouts.batch_metrics(groups_P)
            metrics.update(grpo.train_step(run, groups_P, "importance_sampling", None, adam))
            pool.publish(step + 1, run.tc.save_weights_and_get_sampling_client())
            metrics.update(
                stale_groups=stale,
                off_policy_steps=sum(lags) / len(lags),
                tokens=rollouts.sampled_tokens(groups_P) + metrics["trained_tokens"],
                seconds=time.perf_counter() - started,
            )
            run.step_done(step, metrics)
    finally:
        pool.close()
