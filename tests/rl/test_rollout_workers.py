"""The rollout workers' resampling of stale groups is bounded by ``max_requeues`` (what the dry run's
forecast counts on): past it a stale group is used at its lag instead of being sampled again."""

from __future__ import annotations

import pytest

from sess.engine import SamplingParams
from sess.loops import importance_sampling
from sess.rl.rollout_workers import RolloutWorkers
from sess.rl.rollouts import Group


def pool_of(items: list[tuple[int, int, int]]) -> RolloutWorkers:
    """A pool without worker threads whose finished groups are ``(k, attempt, policy_step)``."""
    pool = RolloutWorkers(
        None,
        None,
        seed=0,
        group_size=2,
        sampling=SamplingParams(),
        workers=0,
        capacity=len(items),
        first_index=0,
        sampler=None,
        policy_step=0,
    )
    for k, attempt, policy_step in items:
        pool.out.put((k, attempt, Group([], policy_step)))
    return pool


def test_a_stale_problem_is_resampled_at_most_max_requeues_times():
    # Problem 7 came back stale at attempts 0 and 1 (each requeued), and at attempt 2 is used at its lag.
    pool = pool_of([(7, 0, 0), (7, 1, 1), (7, 2, 2)])
    group, lag, stale = pool.take_fresh(5, 0, requeue=True, max_requeues=2)
    assert (group.policy_step, lag, stale) == (2, 3, 2)
    assert list(pool.requeued) == [(7, 1), (7, 2)]
    # With room for more, the same stale group is requeued instead.
    pool = pool_of([(7, 2, 2)])
    pool.out.put((8, 0, Group([], 5)))
    group, lag, stale = pool.take_fresh(5, 0, requeue=True, max_requeues=3)
    assert (group.policy_step, lag, stale) == (5, 0, 1) and list(pool.requeued) == [(7, 3)]


def test_discarding_drops_every_stale_group_and_resampling_none_requeues_nothing():
    pool = pool_of([(1, 0, 0), (2, 0, 0), (3, 0, 1), (4, 0, 4)])
    group, lag, stale = pool.take_fresh(4, 1, requeue=False, max_requeues=1)
    assert (group.policy_step, lag, stale) == (4, 0, 3) and not pool.requeued
    # max_requeues=0: the first group is taken whatever its lag.
    pool = pool_of([(1, 0, 0)])
    assert pool.take_fresh(9, 0, requeue=True, max_requeues=0)[1:] == (9, 0) and not pool.requeued


@pytest.mark.parametrize("bad", [-1, True, "2", 1.5])
def test_a_bad_requeue_limit_is_refused_naming_the_field(bad):
    with pytest.raises(ValueError, match="loop.max_requeues"):
        importance_sampling.check(importance_sampling.Config(max_requeues=bad))
    importance_sampling.check(importance_sampling.Config(max_requeues=0))
