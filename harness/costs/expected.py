"""What a run is expected to use, beside the bound (:mod:`.forecast`): the figure a user budgets by.

Every prompt is counted exactly (tokenized as the run renders it). What the config cannot say
comes from a pilot (:mod:`.pilot`), never from a guess:

- replies: the mean length of the pilot's sampled replies (training groups, sampled evaluation) and of
  its greedy ones (evaluation), with the prompts of later turns the pilot's episodes had;
- trained tokens: GRPO-like loops train on a group only when its rewards are not all equal. The
  pilot samples what step 1 samples, so it measures, for the policy the run starts from, the chance
  ``q`` that a group has signal (from each pilot group's reward frequencies, :func:`.share.signal_chance`).
  No learning is assumed, nor that the share stays: whether a policy's groups polarize or mix more
  as it learns depends on the task and the model. The share is taken as the walk of :mod:`.share`
  from ``q`` at step 1, moving by at least its sampling noise (``2 q (1 - q) / batch`` a step) and
  tending to 1/2 as fast as that: a share measured at 1 (every reply's reward differs from another's
  every time) stays; one near the middle stays near it; one in between drifts toward the middle.
  What the run can do bounds the figure's range: every step's share anywhere in 0..1 (none of its
  groups trained, or all of them). Each trained group costs its prompt and the pilot's mean trained
  tail per group (replies and observations);
- code_rl's rollout workers sample ahead: at the end about ``min(rollout_workers, capacity)`` groups
  are sampled and never trained on (the workers' groups in flight); stale groups are taken as none.

SFT samples nothing while training: its trained tokens are exact from the data, and so are the
prompts of its evaluations; only the replies of an evaluation on envs come from the pilot (without
one they are taken at ``loop.max_tokens``, and the basis says so). Env loops without a pilot get no
expected figure, with the reason.
"""

from __future__ import annotations

from dataclasses import dataclass

from sess.rl import rendering
from sess.rl.data import Data

from .forecast import ENV_LOOPS, Forecast, evaluations, planned_steps, prompt_size
from .pilot import Pilot, PilotGroup
from .share import expected_share, noise_rate, signal_chance


@dataclass
class Expected:
    """An expected figure and what it rests on; ``figure`` None when it is not available. ``low`` and
    ``high``: the tokens the run can use as the share of groups that train goes 0..1 (None: the
    figure has no such range, e.g. SFT's, exact from the data)."""

    figure: Forecast | None
    basis: str
    low: int | None = None
    high: int | None = None


def _mean(values: list[float], default: float = 0.0) -> float:
    return sum(values) / len(values) if values else default


def _per_episode(groups: list[PilotGroup], what: str) -> float:
    episodes = sum(g.episodes for g in groups)
    return sum(getattr(g, what) for g in groups) / episodes if episodes else 0.0


def _evaluations(fc: Forecast, cfg, tok, data: Data, pilot: Pilot | None) -> str:
    """Add the run's evaluations; returns what their replies rest on."""
    evals = evaluations(int(cfg.loop.steps), int(cfg.get("eval_every") or 0))
    if data.envs is None:
        if data.chats is not None:  # a forward pass over the held-out chats, billed as prefill
            fc.prefill += evals * sum(len(rendering.chat_tokens(tok, c)[0]) - 1 for c in data.chats.held_out)
        return "evaluations exact"
    held = [prompt_size(tok, make_env)[0] for make_env in data.envs.held_out]
    if pilot is not None and pilot.greedy:
        reply, later = _per_episode(pilot.greedy, "sampled"), _per_episode(pilot.greedy, "later_prefill")
        basis = f"greedy replies {reply:.1f} tokens (pilot)"
    else:
        reply, later = float(cfg.loop.max_tokens), 0.0
        basis = "evaluation replies at loop.max_tokens (no pilot to measure them)"
    fc.prefill += round(evals * (sum(held) + len(held) * later))
    fc.sampled += round(evals * len(held) * reply)
    samples = int(cfg.get("eval_samples") or 0) if cfg.loop.name in ENV_LOOPS else 0
    if samples and pilot is not None:
        sampled = pilot.eval_sampled or pilot.groups
        reply, later = _per_episode(sampled, "sampled"), _per_episode(sampled, "later_prefill")
        fc.prefill += round(evals * (sum(held) + len(held) * samples * later))
        fc.sampled += round(evals * len(held) * samples * reply)
    return basis


def expected(cfg, tok, data: Data, pilot: Pilot | None = None) -> Expected:
    """The expected usage of the run ``cfg`` (a resolved config), its prompts tokenized by ``tok``,
    from a pilot's measurements where the run samples."""
    loop = cfg.loop
    fc = Forecast()
    if loop.name == "sft":
        chats = data.need("chats", loop.name)
        steps, batch = planned_steps(cfg, data), int(loop.batch_size)
        fc.trained = sum(len(rendering.chat_tokens(tok, chats.train(k))[0]) - 1 for k in range(steps * batch))
        return Expected(fc, "training exact from the data; " + _evaluations(fc, cfg, tok, data, pilot))
    if loop.name not in ENV_LOOPS:
        return Expected(None, f"not available: forecasts cover sft, grpo and code_rl, not {loop.name}")
    if pilot is None or not pilot.groups:
        return Expected(
            None,
            "not available without a pilot: reply lengths and the share of groups that train are "
            "measured, not guessed (--dry-run --pilot N samples N prompts)",
        )
    envs = data.need("envs", loop.name)
    steps, batch, group = int(loop.steps), int(loop.batch_size), int(loop.group_size)
    trained_groups = steps * batch
    sampled_groups = trained_groups
    if loop.name == "code_rl":  # the workers' groups in flight when the run ends
        capacity = batch * (int(loop.max_steps_off_policy) + 1)
        sampled_groups += min(int(loop.rollout_workers), capacity)
    prompts = [prompt_size(tok, envs.train(k))[0] for k in range(sampled_groups)]
    reply = _per_episode(pilot.groups, "sampled")
    later = _per_episode(pilot.groups, "later_prefill")
    fc.prefill = round(sum(prompts) + sampled_groups * group * later)
    fc.sampled = round(sampled_groups * group * reply)
    with_signal = [g for g in pilot.groups if g.trained]
    # the chance a group has signal: from its rewards' frequencies (a pilot recorded before rewards
    # were kept: whether it had signal)
    chance = _mean([signal_chance(g.rewards) if g.rewards else float(bool(g.trained)) for g in pilot.groups])
    rate = noise_rate(chance, batch)
    # a trained group's datums: each episode's tokens but the last, i.e. G * (prompt - 1) + its tail
    tail = _mean([g.trained - g.episodes * (g.prompt - 1) for g in with_signal])
    if not with_signal:
        tail = group * _per_episode(pilot.groups, "tail")
    step_tokens = [
        sum(group * (p - 1) + tail for p in prompts[s * batch : (s + 1) * batch]) for s in range(steps)
    ]
    every_group = round(sum(step_tokens))
    fc.trained = round(sum(expected_share(chance, rate, s) * t for s, t in enumerate(step_tokens)))
    evaluated = _evaluations(fc, cfg, tok, data, pilot)
    low = fc.tokens - fc.trained
    basis = (
        f"pilot of {len(pilot.groups)} prompt(s) x {pilot.group_size}: replies {reply:.1f} tokens, "
        f"{len(with_signal)}/{len(pilot.groups)} groups with signal, a group's chance of signal "
        f"{chance:.2f} from its rewards (the share of groups that train taken as a walk from it, "
        f"moving by its sampling noise: {fc.trained / every_group if every_group else 0:.2f} of the "
        f"run's groups; no learning assumed: {low}-{low + every_group} tokens as the share goes 0..1); "
    )
    return Expected(fc, basis + evaluated, low, low + every_group)
