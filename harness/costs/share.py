"""The share of a GRPO-like run's groups that train, ahead of the steps measured: what the expected
figure (:mod:`.expected`) and the projection (:mod:`.spend`) take for the steps not yet run.

A group trains only when its rewards are not all equal, so the share follows what the policy has
learnt: an untrained model's groups mix answers it cannot yet format or get right, a learning one's
polarize (every answer right on easy problems, every one wrong on hard ones), or the other way
round on a task the model starts out failing. Nothing measured before a step says which way it will
go, so the share is modelled as what is known about it and no more: a walk that moves, step to step,
by the mean squared change measured between the run's steps so far, and cannot leave 0..1 (a walk
reflected at both ends). Near the last measured step its expectation is that step's share; further
ahead it tends to 1/2, the mean of a share that could be anywhere in 0..1, as fast as the share has
been seen to move. Before two steps are measured, how fast it moves is not known, and every step
not measured is taken at 1/2. The expectation is exact for such a walk (its Fourier series), with no
constant fitted to any run.

Before the run (a pilot, :mod:`.expected`) nothing has moved yet, but two things are measured: the
chance ``q`` that a group has signal, from each pilot group's reward frequencies (a group of G
episodes drawn with frequencies ``f_k`` has every reward equal with chance ``sum_k f_k^G``), and so
the least the share moves between steps: a step's B groups each with signal at chance ``q`` give a
share whose mean squared change from one step to the next is ``2 q (1 - q) / B``. The expected
figure walks from ``q`` at that rate.
"""

from __future__ import annotations

import math

UNKNOWN = 0.5  # the mean of a share anywhere in 0..1: what a step nothing is known of is taken at
TERMS = 401  # the series to k = 399: within 5e-4 of the mean even for a walk that barely moves


def move_rate(shares: list[float]) -> float | None:
    """The mean squared change of the share from one measured step to the next; None before two."""
    if len(shares) < 2:
        return None
    moves = [(b - a) ** 2 for a, b in zip(shares, shares[1:])]
    return sum(moves) / len(moves)


def expected_share(last: float, rate: float | None, ahead: int) -> float:
    """The expected share ``ahead`` steps after a step measured at ``last``, the share moving by a
    mean squared ``rate`` per step between the walls 0 and 1 (``rate`` None: not known, 1/2)."""
    if ahead <= 0:
        return last
    if rate is None:
        return UNKNOWN
    if rate == 0:  # it has not moved: it stays
        return last
    # a reflected walk's density at step d: 1 + 2 sum_k cos(k pi x) cos(k pi y) exp(-k^2 pi^2 rate d / 2);
    # its mean: 1/2 - sum over odd k of 4 / (k pi)^2 cos(k pi x) exp(-k^2 pi^2 rate d / 2)
    mean = UNKNOWN
    for k in range(1, TERMS, 2):
        kpi = k * math.pi
        mean -= 4 / kpi**2 * math.cos(kpi * last) * math.exp(-(kpi**2) * rate * ahead / 2)
    return min(1.0, max(0.0, mean))


def shares_ahead(shares: list[float], steps_left: int) -> float:
    """The expected number of full batches trained in the ``steps_left`` steps after the measured
    ``shares`` (each step's share of groups with signal, in order; none measured: 1/2 each)."""
    if not shares:
        return UNKNOWN * steps_left
    rate = move_rate(shares)
    return sum(expected_share(shares[-1], rate, d) for d in range(1, steps_left + 1))


def signal_chance(rewards: list[float]) -> float:
    """The chance that a group sampled like this one (its episodes' rewards) has rewards not all
    equal: ``1 - sum_k f_k^G`` over its reward values' frequencies ``f_k``, G its size."""
    size = len(rewards)
    counts: dict[float, int] = {}
    for r in rewards:
        counts[r] = counts.get(r, 0) + 1
    return 1 - sum((c / size) ** size for c in counts.values()) if size else 0.0


def noise_rate(share: float, batch: int) -> float:
    """The mean squared change between two steps' shares when each of a step's ``batch`` groups has
    signal independently with chance ``share``: ``2 share (1 - share) / batch``."""
    return 2 * share * (1 - share) / max(1, batch)
