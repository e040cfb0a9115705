"""The native room's build (engine/native/build.py): built once per machine into a disk cache that a
second process loads without a compiler, and safe when two processes build at once."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sess.engine.native import build

# a child that refuses to start any process (a compiler above all), then loads the kernels and runs one
NO_COMPILER = """
import subprocess
def refuse(*args, **kwargs):
    raise AssertionError(f"started a process: {args[0]}")
subprocess.run = subprocess.Popen = refuse
import torch
from sess.engine.native import kernels
lib, how = kernels.library()
gate, up = torch.randn(3, 40), torch.randn(3, 40)
out = torch.empty(3, 40)
assert lib.sess_silu_mul(gate, 40, up, 40, 3, 40, out, 1) == 0
assert torch.allclose(out, torch.nn.functional.silu(gate) * up, atol=1e-6)
print(how)
"""

# a child that waits for the go file, builds the OpenMP timing program, and says whether it compiled
RACE = """
import sys, time
from pathlib import Path
from sess.engine.native import build
ready, go = Path(sys.argv[1]), Path(sys.argv[2])
ready.touch()
while not go.exists():
    time.sleep(0.005)
built = build.build("openmp_spin", ("spin.c",), ("-O2",))
print(built.compiled, built.path)
"""


def _child(code: str, cache: Path, *args: str) -> subprocess.Popen:
    env = {**os.environ, "SESS_KERNEL_CACHE": str(cache)}
    return subprocess.Popen([sys.executable, "-c", code, *args], env=env, stdout=subprocess.PIPE, text=True)


def _needs_compiler():
    if build.c_compiler() is None:
        pytest.skip("no C compiler here")


def test_a_second_process_loads_the_cached_kernels_without_a_compiler(tmp_path):
    _needs_compiler()
    from sess.engine.native import kernels

    first = subprocess.run(
        [sys.executable, "-c", "from sess.engine.native import kernels; print(kernels.library()[1])"],
        env={**os.environ, "SESS_KERNEL_CACHE": str(tmp_path)},
        capture_output=True,
        text=True,
        check=True,
    )
    assert first.stdout.startswith("built for this CPU"), first.stdout + first.stderr
    if kernels.library()[0] is None:
        pytest.skip(f"the kernels are not usable in a process here: {kernels.library()[1]}")
    second = _child(NO_COMPILER, tmp_path)
    out, _ = second.communicate(timeout=300)
    assert second.returncode == 0
    assert out.startswith("loaded from the build cache for this CPU (sess_kernels-")
    assert [p.name for p in tmp_path.iterdir() if p.suffix == ".so"] == [out.split("(")[1].rstrip(")\n")]


def test_two_processes_building_at_once_both_succeed_with_one_artifact(tmp_path):
    _needs_compiler()
    cache, go = tmp_path / "cache", tmp_path / "go"
    children = [_child(RACE, cache, str(tmp_path / f"ready{i}"), str(go)) for i in range(2)]
    deadline = time.monotonic() + 120
    while not all((tmp_path / f"ready{i}").exists() for i in range(2)) and time.monotonic() < deadline:
        time.sleep(0.01)
    go.touch()  # both start building now
    results = [child.communicate(timeout=180)[0].split() for child in children]
    assert [child.returncode for child in children] == [0, 0]
    assert sorted(compiled for compiled, _ in results) == ["False", "True"]  # one compiled, one waited
    artifacts = [p for p in cache.iterdir() if not p.name.endswith(".lock")]
    assert [str(p) for p in artifacts] == [results[0][1]] == [results[1][1]]  # no partial file left
    ran = subprocess.run([results[0][1]], capture_output=True, text=True, check=True)
    assert float(ran.stdout) > 0


def test_the_key_changes_with_sources_flags_compiler_and_cpu(tmp_path, monkeypatch):
    _needs_compiler()
    source = tmp_path / "a.c"
    source.write_text("int f(void) { return 1; }\n")
    compiler = build.c_compiler()
    base = build.key([source], ("-O2",), compiler)
    assert build.key([source], ("-O2",), compiler) == base
    assert build.key([source], ("-O3",), compiler) != base
    other = tmp_path / "other-cc"
    other.write_bytes(Path(compiler).resolve().read_bytes() + b"\0")
    assert build.key([source], ("-O2",), str(other)) != base
    monkeypatch.setattr(build, "cpu", lambda: "another CPU")
    assert build.key([source], ("-O2",), compiler) != base
    monkeypatch.undo()
    source.write_text("int f(void) { return 2; }\n")
    assert build.key([source], ("-O2",), compiler) != base


def test_the_cache_is_the_env_var_else_the_platform_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("SESS_KERNEL_CACHE", str(tmp_path))
    assert build.cache_dir() == tmp_path
    monkeypatch.delenv("SESS_KERNEL_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert build.cache_dir() == tmp_path / "xdg" / "sess" / "kernels"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert build.cache_dir() == Path.home() / ".cache" / "sess" / "kernels"


def test_a_compiler_that_fails_says_why_and_leaves_nothing(monkeypatch, tmp_path):
    monkeypatch.setenv("SESS_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "false")
    with pytest.raises(build.BuildError, match="false failed"):
        build.build("openmp_spin", ("spin.c",), ("-O2",))
    assert [p for p in tmp_path.iterdir() if not p.name.endswith(".lock")] == []
    monkeypatch.setenv("CC", "/nonexistent/cc")
    with pytest.raises(build.BuildError, match="no C compiler"):
        build.build("openmp_spin", ("spin.c",), ("-O2",))
