"""A pilot: a few of a run's own prompts sampled on the live model, no training, to measure what the
expected figure (:mod:`.expected`) rests on (``sess run --dry-run --pilot N``).

It samples the first ``N`` problems of the run's first step exactly as that step does (the same
envs, seeds, temperature, ``max_tokens`` and turn caps) with the base model, which is what the run's
fresh LoRA adapter samples before its first update; and the first ``N`` held-out problems as the
run's first evaluation does (greedy, and ``eval_samples`` sampled answers each where the run has
them). Of each group it keeps what the run would be billed for: the prompt, the sampled tokens, the
prompts of later turns, and the tokens the loop would train on (none when the group's rewards are
all equal: GRPO-like loops learn nothing from such a group and send it nowhere). The pilot itself
is billed like any sampling: at most ``N`` groups' prompts and replies (:func:`pilot_bound`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from sess.engine import SamplingParams
from sess.rl import rollouts
from sess.rl.data import Data
from sess.rl.rollouts import Group, derive_seed

from .forecast import ENV_LOOPS, Forecast, add_episodes, prompt_size


@dataclass
class PilotGroup:
    """One sampled group (or one greedy episode) as the run would be billed for it."""

    prompt: int  # tokens of its first prompt (prefilled once for the whole group)
    episodes: int
    sampled: int  # tokens sampled over its episodes
    later_prefill: int = 0  # prompts of later turns (multi-turn episodes: the episode so far)
    tail: int = 0  # tokens after the first prompt over its episodes (replies and observations)
    trained: int = 0  # tokens the loop trains on (0: every reward equal, no signal)
    rewards: list[float] = field(default_factory=list)  # each episode's reward (training groups)


@dataclass
class Pilot:
    prompts: int  # problems of the first step sampled (the N of --pilot N)
    group_size: int
    groups: list[PilotGroup] = field(default_factory=list)  # the first step's first N groups
    greedy: list[PilotGroup] = field(default_factory=list)  # the first evaluation's first N episodes
    eval_sampled: list[PilotGroup] = field(default_factory=list)  # and its sampled answers (eval_samples)

    @property
    def tokens(self) -> dict[str, int]:
        """What the pilot itself was billed, by kind."""
        every = [*self.groups, *self.greedy, *self.eval_sampled]
        return {
            "prefill": sum(g.prompt + g.later_prefill for g in every),
            "sampled": sum(g.sampled for g in every),
            "trained": 0,
        }

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> Pilot:
        lists = {
            key: [PilotGroup(**g) for g in data.get(key, [])] for key in ("groups", "greedy", "eval_sampled")
        }
        return cls(prompts=int(data["prompts"]), group_size=int(data["group_size"]), **lists)


def pilot_bound(cfg, tok, data: Data, prompts: int) -> int:
    """At most how many tokens a pilot of ``prompts`` problems is billed (every reply at
    ``max_tokens``, every turn the loop allows), before it runs."""
    loop, fc = cfg.loop, Forecast()
    cap = loop.get("max_turns")
    observation = int(loop.get("max_observation_tokens") or rollouts.MAX_OBSERVATION_TOKENS)
    envs = data.envs
    if envs is None:
        return 0
    max_tokens = int(loop.max_tokens)
    for make_env, members in _plan(cfg, data, prompts):
        prompt, tools = prompt_size(tok, make_env)
        turns = int(cap) if cap else (rollouts.DEFAULT_MAX_TURNS if tools else 1)
        add_episodes(fc, prompt, members, max_tokens, turns, observation)
    return fc.tokens


def _plan(cfg, data: Data, prompts: int) -> list[tuple]:
    """(env factory, members) of each group the pilot samples: training groups, greedy, sampled eval."""
    loop, envs = cfg.loop, data.envs
    plan = []
    if loop.name in ENV_LOOPS:
        plan += [(envs.train(i), int(loop.group_size)) for i in range(prompts)]
    held = envs.held_out[:prompts]
    plan += [(make_env, 1) for make_env in held]
    if loop.name in ENV_LOOPS and int(cfg.get("eval_samples") or 0):
        plan += [(make_env, int(cfg.eval_samples)) for make_env in held]
    return plan


def run_pilot(cfg, sampler, tok, data: Data, prompts: int) -> Pilot:
    """Sample ``prompts`` problems of the run ``cfg`` with ``sampler`` (a SamplingClient of the base
    model) as its first step and first evaluation do; nothing is trained."""
    if prompts < 1:
        raise ValueError(f"--pilot: expected 1 or more prompts, got {prompts}")
    loop = cfg.loop
    env_loop = loop.name in ENV_LOOPS
    pilot = Pilot(prompts=prompts, group_size=int(loop.group_size) if env_loop else 1)
    envs = data.envs
    if envs is None:
        return pilot  # nothing sampled in this run (chats evaluated by a forward pass)
    caps = {
        "max_turns": loop.get("max_turns") if env_loop else None,
        "max_observation_tokens": loop.get("max_observation_tokens"),
    }
    max_tokens, seed = int(loop.max_tokens), int(cfg.seed)
    if env_loop:
        # the seeds of the first step's groups: grpo's (step 0, prompt i), the workers' (problem i, attempt 0)
        seeds = [
            derive_seed(seed, "sample", 0, i) if loop.name == "grpo" else derive_seed(seed, "sample", i, 0)
            for i in range(prompts)
        ]
        params = SamplingParams(max_tokens=max_tokens, temperature=float(loop.temperature))
        envs_P_G = [[envs.train(i)() for _ in range(pilot.group_size)] for i in range(prompts)]
        groups = rollouts.rollout_groups(sampler, tok, envs_P_G, params, seeds, **caps)
        stream = bool(loop.get("stream"))
        for group in groups:
            datums = (
                rollouts.group_datums(group, int(loop.batch_size))
                if stream
                else rollouts.batch_datums([group])
            )
            measured = _measure(group, sum(d.model_input.length for d in datums))
            measured.rewards = [float(r) for r in group.rewards_G]
            pilot.groups.append(measured)
    held = envs.held_out[:prompts]
    greedy = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    seeds = [derive_seed(seed, "sample", 0, i) for i in range(len(held))]  # the first evaluation's
    groups = rollouts.rollout_groups(sampler, tok, [[make_env()] for make_env in held], greedy, seeds, **caps)
    pilot.greedy = [_measure(g, 0) for g in groups]
    if env_loop and (samples := int(cfg.get("eval_samples") or 0)):
        params = SamplingParams(max_tokens=max_tokens, temperature=float(loop.temperature))
        seeds = [derive_seed(seed, "eval-sampled", i) for i in range(len(held))]
        envs_P_G = [[make_env() for _ in range(samples)] for make_env in held]
        groups = rollouts.rollout_groups(sampler, tok, envs_P_G, params, seeds, **caps)
        pilot.eval_sampled = [_measure(g, 0) for g in groups]
    return pilot


def _measure(group: Group, trained: int) -> PilotGroup:
    """A group's billed tokens: its first prompt once, each later turn's prompt (the episode up to
    that reply), its sampled tokens."""
    episodes = group.episodes_G
    if not episodes:  # the env could not open: nothing sampled
        return PilotGroup(prompt=0, episodes=0, sampled=0)
    prompt = episodes[0].sampled_T.index(True) if any(episodes[0].sampled_T) else len(episodes[0].tokens_T)
    later = 0
    for e in episodes:
        starts = [t for t in range(1, len(e.sampled_T)) if e.sampled_T[t] and not e.sampled_T[t - 1]]
        later += sum(t for t in starts if t > prompt)
    return PilotGroup(
        prompt=prompt,
        episodes=len(episodes),
        sampled=sum(e.n_sampled for e in episodes),
        later_prefill=later,
        tail=sum(len(e.tokens_T) - prompt for e in episodes),
        trained=trained,
    )
