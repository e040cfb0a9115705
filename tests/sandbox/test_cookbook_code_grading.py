"""tinker-cookbook's code-RL grader, unmodified, against ``python -m sess.sandbox.server`` (slow: the
cookbook's venv takes minutes to build). ``code_rl.code_grading.sandbox_check_correctness`` posts
SandboxFusion's ``/run_code`` with its test runner, the tests and the solution as ``files``
(``testing_util.py``, ``test_cases.txt``, ``code.py``) and reads ``status == "Success"``: a correct
stdin-style solution and a correct functional one (``class Solution``) pass, a wrong one and one that
hangs fail, each for its own reason. The grader's script imports numpy: the sandbox's interpreter
(this one's base installation) must have it, as SandboxFusion's image does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import sandbox_server
from tinker_helpers import make_cookbook_venv, run_client

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cookbook(tmp_path_factory) -> Path:
    return make_cookbook_venv(tmp_path_factory.mktemp("cookbook"))


def test_the_cookbooks_code_grader_passes_correct_solutions_and_fails_the_rest(cookbook, tmp_path):
    with sandbox_server(20) as url:  # above the recipe's run_timeout, so its own per-test alarm rules
        spec = {"out": str(tmp_path / "grading.json"), "timeout": 6}  # the recipe's per-test default
        verdicts = run_client(
            cookbook, "code_grading.py", spec, url="", key="", env={"SANDBOX_URL": f"{url}/run_code"}
        )
    for name in ("stdin_correct", "functional_correct"):
        assert verdicts[name]["passed"] is True, json.dumps(verdicts[name])[:2000]
        assert verdicts[name]["details"]["run_result"]["return_code"] == 0
    wrong, hangs = verdicts["stdin_wrong"], verdicts["stdin_hangs"]
    assert wrong["passed"] is False and "Wrong Answer" in wrong["details"]["run_result"]["stdout"]
    assert hangs["passed"] is False and "Time Limit Exceeded" in hangs["details"]["run_result"]["stdout"]
    assert 5 < hangs["seconds"] < 20, hangs["seconds"]  # the recipe's 6 s alarm, not a server failure
