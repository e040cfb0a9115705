"""Run under tinker-cookbook's own venv (see tests/test_cookbook_code_grading.py) with SANDBOX_URL
set: the cookbook's code_rl grader, unmodified, on four solutions; writes each verdict to spec["out"]."""

import asyncio
import json
import sys
import time

from tinker_cookbook.recipes.code_rl.code_grading import sandbox_check_correctness

spec = json.loads(sys.argv[1])
STDIN_TESTS = [
    {"input": "1 2\n", "output": "3\n", "testtype": "stdin_stdout", "metadata": {}},
    {"input": "10 -4\n", "output": "6\n", "testtype": "stdin_stdout", "metadata": {}},
]
FUNCTIONAL_TESTS = [
    {
        "input": "[2, 7, 11, 15]\n9",
        "output": "[0, 1]",
        "testtype": "functional",
        "metadata": {"func_name": "twoSum"},
    },
    {
        "input": "[3, 2, 4]\n6",
        "output": "[1, 2]",
        "testtype": "functional",
        "metadata": {"func_name": "twoSum"},
    },
]
TWO_SUM = """
class Solution:
    def twoSum(self, nums, target):
        seen = {}
        for i, n in enumerate(nums):
            if target - n in seen:
                return [seen[target - n], i]
            seen[n] = i
"""
CASES = {
    "stdin_correct": (STDIN_TESTS, "a, b = map(int, input().split())\nprint(a + b)\n"),
    "functional_correct": (FUNCTIONAL_TESTS, TWO_SUM),
    "stdin_wrong": (STDIN_TESTS, "a, b = map(int, input().split())\nprint(a - b)\n"),
    "stdin_hangs": (STDIN_TESTS, "import time\nwhile True:\n    time.sleep(1)\n"),
}


async def grade() -> dict:
    out = {}
    for name, (tests, solution) in CASES.items():
        start = time.monotonic()
        passed, details = await sandbox_check_correctness(tests, solution, timeout=spec["timeout"])
        out[name] = {"passed": passed, "details": details, "seconds": time.monotonic() - start}
    return out


with open(spec["out"], "w") as f:
    json.dump(asyncio.run(grade()), f, default=str)
