"""Rollout workers: threads that keep sampling groups while the trainer trains (the off-policy loops' pool).

``workers`` threads each take the next problem index k (or a requeued ``(k, attempt)``), run one group
of that problem with the newest published policy, and put ``(k, attempt, group)`` on a queue as soon as
it is done, the group tagged with the policy's step. ``capacity`` bounds how many groups are sampled
ahead of the trainer (the loops use ``batch_size * (max_steps_off_policy + 1)``), so a slow trainer
does not let the workers run arbitrarily far ahead on old weights. The trainer ``take``s groups (``take_fresh``: no more than a given lag behind),
``publish``es each new policy and ``requeue``s a group that came back too stale, which samples that
problem again (attempt + 1) from the newest policy, up to a limit of resamples per problem. Problem k's attempt a samples with the seed
(run seed, k, a). An error in a worker (the engine failed; envs' own errors stay in their episodes, see
:mod:`.rollouts`) is raised in the trainer at its next ``take``.
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from collections.abc import Callable

from sess.engine import SamplingParams

from . import rollouts
from .data import Dataset
from .env import EnvFactory
from .rollouts import Group, check_count, derive_seed


def check_requeue_limit(value) -> None:
    """Refuse a ``loop.max_requeues`` that is not an integer >= 0."""
    check_count("loop.max_requeues", value, 0)


class RolloutWorkers:
    def __init__(
        self,
        tok,
        envs: Dataset[EnvFactory],
        *,
        seed: int,
        group_size: int,
        sampling: SamplingParams,
        workers: int,
        capacity: int,
        first_index: int,
        sampler,
        policy_step: int,
        max_turns: int | None = None,
        max_observation_tokens: int | None = None,
        trainer_logprobs: bool = False,
    ):
        self.tok, self.envs, self.seed, self.group_size = tok, envs, seed, group_size
        self.sampling, self.max_turns, self.trainer_logprobs = sampling, max_turns, trainer_logprobs
        self.max_observation_tokens = max_observation_tokens
        self.next_index = first_index
        self.requeued: deque[tuple[int, int]] = deque()
        self.policy = (policy_step, sampler)
        self.lock = threading.Lock()
        self.out: queue.Queue = queue.Queue()
        self.room = threading.Semaphore(capacity)
        self.stopping = threading.Event()
        self.errors: list[BaseException] = []
        self.threads = [
            threading.Thread(target=self._work, name=f"rollout-{i}", daemon=True) for i in range(workers)
        ]
        for t in self.threads:
            t.start()

    def publish(self, policy_step: int, sampler) -> None:
        """Groups started from now on sample with ``sampler`` (the weights after ``policy_step`` steps)."""
        with self.lock:
            self.policy = (policy_step, sampler)

    def requeue(self, k: int, attempt: int) -> None:
        with self.lock:
            self.requeued.append((k, attempt + 1))

    def take(self, on_wait: Callable[[], None] | None = None) -> tuple[int, int, Group]:
        """The next finished group as ``(k, attempt, group)``, in the order groups finish."""
        while True:
            if self.errors:
                raise self.errors[0]
            try:
                item = self.out.get(timeout=0.5)
            except queue.Empty:
                if on_wait is not None:
                    on_wait()
                continue
            self.room.release()
            return item

    def take_fresh(self, step: int, max_lag: int, requeue: bool, max_requeues: int) -> tuple[Group, int, int]:
        """The next finished group sampled at most ``max_lag`` policy steps before ``step``, as
        ``(group, lag, stale)``: ``stale`` groups came back older and were requeued (``requeue``,
        sampled again from the newest policy) or dropped on the way.

        ``max_requeues`` bounds the resampling: a problem already sampled again that many times is
        taken at whatever lag it has. What the run samples is then bounded by its config (what ``sess
        run --dry-run`` forecasts): problems are started only while fewer than ``capacity`` are
        pending (sampling, done, or requeued), so each problem trained on, plus at most ``capacity``
        left at the end, is sampled at most ``max_requeues + 1`` times; and since a group started
        after policy ``s`` is published is fresh at step ``s``, each step takes at most ``capacity``
        stale groups (the bound for ``discard``, which drops every stale group)."""
        stale = 0
        while True:
            k, attempt, group = self.take()
            lag = step - group.policy_step
            if lag <= max_lag or (requeue and attempt >= max_requeues):
                return group, lag, stale
            stale += 1
            if requeue:
                self.requeue(k, attempt)

    def _work(self) -> None:
        while not self.stopping.is_set():
            if not self.room.acquire(timeout=0.2):
                continue
            with self.lock:
                if self.requeued:
                    k, attempt = self.requeued.popleft()
                else:
                    k, attempt = self.next_index, 0
                    self.next_index += 1
                policy_step, sampler = self.policy
            try:
                make_env = self.envs.train(k)
                envs_G = [make_env() for _ in range(self.group_size)]
            except Exception as exc:  # an env that cannot be built loses its group, not the run
                self.out.put(
                    (k, attempt, Group([], policy_step, error=f"env raised when built: {exc!r}"[:300]))
                )
                continue
            try:
                seed = derive_seed(self.seed, "sample", k, attempt)
                (group,) = rollouts.rollout_groups(
                    sampler,
                    self.tok,
                    [envs_G],
                    self.sampling,
                    [seed],
                    policy_step=policy_step,
                    max_turns=self.max_turns,
                    max_observation_tokens=self.max_observation_tokens,
                    trainer_logprobs=self.trainer_logprobs,
                )
            except BaseException as exc:  # surfaced to the trainer at its next take()
                self.errors.append(exc)
                return
            self.out.put((k, attempt, group))

    def close(self) -> None:
        self.stopping.set()
        for t in self.threads:
            t.join(timeout=30)
