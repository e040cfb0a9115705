"""Run under tinker-cookbook's own venv (tests/tinker/test_cookbook_recipes.py): the code_rl recipe's
own first messages for each stand-in task (its tool prefix and LiveCodeBench prompt, built by the
cookbook's ``code_env``), answered with the task's solution in a python code block: a chat JSON-lines
file for ``chat_sl``, so a short SFT teaches the model the answer format the recipe grades."""

import json
import sys

from tinker_cookbook import renderers
from tinker_cookbook.recipes.code_rl.code_env import DeepcoderTool, _build_question, _initial_messages
from tinker_cookbook.recipes.code_rl.deepcoder_tool import DeepcoderTask
from tinker_cookbook.tokenizer_utils import get_tokenizer

spec = json.loads(sys.argv[1])
renderer = renderers.get_renderer(spec["renderer_name"], tokenizer=get_tokenizer(spec["model_name"]))
rows = []
for problem, solution in spec["tasks"]:
    task = DeepcoderTask(problem=_build_question({"problem": problem}), tests=[])
    messages = _initial_messages(task, renderer, DeepcoderTool(task))
    messages.append({"role": "assistant", "content": f"```python\n{solution}\n```"})
    rows.append({"messages": messages})
with open(spec["path"], "w") as f:
    for row in rows * spec["repeats"]:
        f.write(json.dumps(row) + "\n")
with open(spec["out"], "w") as f:
    json.dump({"rows": len(rows) * spec["repeats"], "first": rows[0]["messages"]}, f)
