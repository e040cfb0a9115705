"""``data=arithmetic``: generated problems as one-turn envs, as chats with a worked answer, and as feedback.

Envs are :class:`~.problem_env.ProblemEnv` episodes (reward: the exact final answer); chats end with
the worked answer (``... Answer: <n>``) SFT learns; feedback pairs the worked answer (desirable) with
the same story ending in a wrong answer, for KTO.
"""

from __future__ import annotations

from sess.rl.data import Data, Dataset, Feedback
from sess.rl.env import EnvFactory, Messages

from .problem_env import ProblemEnv, problem_prompt
from .problems import ArithmeticData, ArithmeticProblems, Problem


def answer_text(problem: Problem) -> str:
    return f"{problem.solution} Answer: {problem.answer}".strip()


def problem_chat(problem: Problem, instruction: str) -> Messages:
    return [*problem_prompt(problem, instruction), {"role": "assistant", "content": answer_text(problem)}]


def problem_env(problem: Problem, cfg) -> EnvFactory:
    return lambda: ProblemEnv(problem, cfg.instruction, cfg.format_penalty)


def load_arithmetic(cfg: ArithmeticData, seed: int) -> Data:
    gen = ArithmeticProblems(seed, cfg)

    def feedback(k: int, problem: Problem) -> Feedback:
        # Even k: the correct worked answer (desirable); odd k: the same story with a wrong answer.
        prompt = problem_prompt(problem, cfg.instruction)
        if k % 2 == 0:
            return Feedback(prompt, answer_text(problem), True)
        wrong = gen.wrong_answer(k, problem)
        return Feedback(prompt, f"{problem.solution.rsplit('=', 1)[0]}= {wrong}. Answer: {wrong}", False)

    held = gen.eval_problems
    return Data(
        "arithmetic",
        envs=Dataset(lambda k: problem_env(gen.train(k), cfg), [problem_env(p, cfg) for p in held]),
        chats=Dataset(
            lambda k: problem_chat(gen.train(k), cfg.instruction),
            [problem_chat(p, cfg.instruction) for p in held],
        ),
        feedback=Dataset(
            lambda k: feedback(k, gen.train(k // 2 * 2)), [feedback(k, p) for k, p in enumerate(held)]
        ),
    )
