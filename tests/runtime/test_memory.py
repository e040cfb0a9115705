"""The engine's malloc settings (engine/memory.py): freed memory is reused, not faulted in again."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from sess.engine.runtime.memory import openmp_spin
from sess.engine.runtime.memory.malloc_tuning import (
    ENGINE_MALLOC,
    ONEDNN_CACHES,
    OPENMP_USER,
    engine_env,
    jemalloc_library,
)

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc settings")

# allocate and free 20 tensors of 12 MB three times (as training steps' activations come and go),
# then report the page faults of the last round (the first two settle the heap's layout)
PROBE = """
import resource, torch
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(3):
    before = faults()
    xs = [torch.empty(3 * 2**20).fill_(1.0) for _ in range(20)]
    del xs
print(faults() - before)
"""


def _last_round_faults(env: dict[str, str]) -> int:
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True)
    return int(out.stdout.split()[-1])


@linux
def test_freed_memory_is_reused_under_the_engine_settings():
    plain = {k: v for k, v in os.environ.items() if k not in ENGINE_MALLOC}
    # glibc's default maps each 12 MB block afresh until its dynamic threshold happens to rise past
    # it (it did in about a third of runs); the initial threshold, held fixed, is what blocks above
    # the dynamic range (32 MB; a step's logits are hundreds of MB) always get
    baseline = {**plain, "SESS_MALLOC": "system", "MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}
    default = _last_round_faults(baseline)
    engine = _last_round_faults(engine_env(plain))
    assert default > 50_000  # 240 MB of fresh 4 KiB pages again
    assert engine < default / 5  # mostly the pages of the rounds before


# 20 blocks of 12 MB and 3 of 88 MB (a chunk's logits), allocated and freed three times; the last
# round's page faults, and what the process holds once they are freed
BIG_PROBE = """
import resource, torch
def rss():
    return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmRSS"))
start = rss()
for _ in range(3):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    xs = [torch.empty(3 * 2**20).fill_(1.0) for _ in range(20)] + [torch.empty(22 * 2**20).fill_(1.0) for _ in range(3)]
    del xs
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before, rss() - start)
"""


def _huge_pages_possible() -> bool:
    try:
        setting = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    except OSError:
        return False
    return "[always]" in setting or "[madvise]" in setting


@linux
@pytest.mark.skipif(not _huge_pages_possible(), reason="the kernel has transparent huge pages off")
def test_big_blocks_go_back_when_freed_and_come_in_huge_pages():
    """Why the peak is what the live tensors take: blocks of MMAP_FROM or more are mapped on their
    own and unmapped when freed (the heap kept them and fragmented), and they fault in 2 MiB pages,
    so mapping them afresh every step costs about what reusing the heap did."""
    plain = {k: v for k, v in os.environ.items() if k not in ENGINE_MALLOC}
    out = subprocess.run(
        [sys.executable, "-c", BIG_PROBE], env=engine_env(plain), capture_output=True, text=True, check=True
    )
    faults, held = map(int, out.stdout.split()[-2:])
    default = _last_round_faults(
        {**plain, "SESS_MALLOC": "system", "MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}
    )
    assert held < 32 * 2**20  # of the 500 MB freed, none kept
    assert faults < default / 5  # 4 KiB pages would take ~130,000 faults a round


def test_engine_env_keeps_user_choices():
    assert all(engine_env({})[k] == v for k, v in ENGINE_MALLOC.items()) or not sys.platform.startswith(
        "linux"
    )
    assert not set(ENGINE_MALLOC) & set(engine_env({"SESS_MALLOC": "system"}))
    assert engine_env({"MALLOC_ARENA_MAX": "4"})["MALLOC_ARENA_MAX"] == "4"
    # a GPU engine's tensors live in the CUDA caching allocator: glibc keeps its defaults there
    assert not set(ENGINE_MALLOC) & set(engine_env({}, device="cuda"))


# oneDNN linear layers at 120 row counts x 3 weight shapes (a primitive each, as the sampler's
# prefills make them), then the bytes malloc holds more than before (mallinfo2: glibc)
ONEDNN_PROBE = """
import ctypes, torch
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in "a b c d hblkhd e f uordblks g h".split()]
info = ctypes.CDLL("libc.so.6").mallinfo2
info.restype = Info
def used():
    m = info()
    return m.uordblks + m.hblkhd
weights = [torch.randn(o, 64) for o in (64, 96, 160)]
before = used()
for rows in range(17, 137):
    for w in weights:
        torch.ops.mkldnn._linear_pointwise(torch.randn(rows, 64), w, None, "none", [], "")
print(used() - before)
"""


@linux
@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="oneDNN")
def test_an_engine_s_onednn_caches_stay_small_however_many_shapes_it_meets():
    plain = {k: v for k, v in os.environ.items() if k not in ONEDNN_CACHES}
    held = {}
    for name, env in (
        ("default", {**plain, **{k: "1024" for k in ONEDNN_CACHES}}),
        ("engine", engine_env(plain)),
    ):
        out = subprocess.run(
            [sys.executable, "-c", ONEDNN_PROBE], env=env, capture_output=True, text=True, check=True
        )
        held[name] = int(out.stdout.split()[-1])
    assert all(engine_env(plain)[k] == v for k, v in ONEDNN_CACHES.items())
    assert engine_env({"LRU_CACHE_CAPACITY": "8"})["LRU_CACHE_CAPACITY"] == "8"  # a user's choice stays
    assert not set(ONEDNN_CACHES) & set(engine_env({}, device="cuda"))
    # 360 primitives: ~0.2 MB each with the libraries' defaults, a bounded few with the engine's caps
    assert held["engine"] < held["default"] / 4, held


# under the engine settings (the heap is never trimmed by itself), allocate and free 400 MB in
# blocks below MMAP_FROM (the heap's), then trim
TRIM_PROBE = """
import torch
from sess.engine.runtime.memory.malloc_tuning import trim
def rss():
    return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmRSS"))
xs = [torch.ones(2**18) for _ in range(400)]
del xs
held = rss()
trim()
print(held - rss())
"""


@linux
def test_trim_hands_the_heap_s_free_memory_back():
    out = subprocess.run(
        [sys.executable, "-c", TRIM_PROBE], env=engine_env(), capture_output=True, text=True, check=True
    )
    assert int(out.stdout.split()[-1]) > 300 * 2**20


def test_an_idle_executor_calls_its_idle_hook_once_per_quiet_spell(tmp_path):
    """What lets an idle engine hand memory back (ManagedEngine.idle): called after idle_after_s
    without work, once, and again only after more work."""
    import time

    from sess.engine.runtime.executor import Executor

    class Watched(Executor):
        idle_after_s = 0.3
        calls = 0

        def idle(self):
            Watched.calls += 1

    engine = Watched(home=tmp_path)
    try:
        time.sleep(1.6)
        assert Watched.calls == 1
        engine.run(lambda runtime: None)
        time.sleep(1.6)
        assert Watched.calls == 2
    finally:
        engine.close()


@linux
def test_engine_process_starts_with_the_settings(http_engine):
    environ = open(f"/proc/{http_engine['pid']}/environ", "rb").read().split(b"\0")
    for key, value in ENGINE_MALLOC.items():
        assert f"{key}={value}".encode() in environ
    # the spin count its own process timed (this one's may differ by the timing's noise)
    (count,) = [int(line.split(b"=")[1]) for line in environ if line.startswith(b"GOMP_SPINCOUNT=")]
    assert openmp_spin.LEAST <= count <= openmp_spin.MOST


# libgomp reports the spin count it runs with (torch's OpenMP on Linux; other runtimes say nothing)
SPIN_PROBE = "import torch; torch.ones(64, 64) @ torch.ones(64, 64)"


def _spin_count(env: dict[str, str]) -> str | None:
    out = subprocess.run(
        [sys.executable, "-c", SPIN_PROBE],
        env={**env, "OMP_DISPLAY_ENV": "VERBOSE"},
        capture_output=True,
        text=True,
        check=True,
    )
    line = next((line for line in out.stderr.splitlines() if "GOMP_SPINCOUNT" in line), None)
    return line.split("=")[1].strip().strip("'") if line else None


def test_an_engine_s_openmp_threads_spin_for_a_set_time():
    """Between parallel regions libgomp's threads spin (300,000 iterations) before they sleep; on
    shared cores the spinning takes the cores from the thread with work. An engine's threads spin
    :data:`~.openmp_spin.SPIN_SECONDS`, counted for this CPU; a user's own policy or count stays."""
    plain = {k: v for k, v in os.environ.items() if k not in OPENMP_USER}
    default = _spin_count(plain)
    if default is None:
        pytest.skip("torch's OpenMP runtime is not libgomp: it does not report its spin count")
    count = openmp_spin.spin_count()
    assert openmp_spin.LEAST <= count <= openmp_spin.MOST == int(default)
    assert _spin_count(engine_env(plain)) == str(count)
    assert _spin_count(engine_env({**plain, "OMP_WAIT_POLICY": "PASSIVE"})) == "0"
    assert engine_env({"OMP_WAIT_POLICY": "ACTIVE"})["OMP_WAIT_POLICY"] == "ACTIVE"
    assert "GOMP_SPINCOUNT" not in engine_env({"OMP_WAIT_POLICY": "ACTIVE"})
    assert engine_env({"GOMP_SPINCOUNT": "0"})["GOMP_SPINCOUNT"] == "0"
    assert "GOMP_SPINCOUNT" not in engine_env({}, device="cuda")


def test_the_spin_count_is_the_set_time_over_one_iteration_of_libgomp_s_loop(monkeypatch):
    """The count spins SPIN_SECONDS at the loop's timed speed, kept within libgomp's own bounds;
    where the loop cannot be timed (no C compiler) the count is the fixed fallback."""
    ns = openmp_spin.iteration_ns()
    if ns is None:
        pytest.skip("no C compiler here: the count is the fallback")
    assert ns > 0
    cases = ((ns, round(openmp_spin.SPIN_SECONDS * 1e9 / ns)), (1e-6, openmp_spin.MOST), (1e6, openmp_spin.LEAST))
    for timed, expected in cases:
        monkeypatch.setattr(openmp_spin, "iteration_ns", lambda timed=timed: timed)
        openmp_spin.spin_count.cache_clear()
        assert openmp_spin.spin_count() == min(openmp_spin.MOST, max(openmp_spin.LEAST, expected))
    monkeypatch.undo()
    monkeypatch.setenv("CC", "no-such-compiler")
    assert openmp_spin.iteration_ns() is None
    openmp_spin.spin_count.cache_clear()
    assert openmp_spin.spin_count() == openmp_spin.FALLBACK
    openmp_spin.spin_count.cache_clear()


@linux
def test_exec_as_engine_restarts_a_process_under_the_settings_once(tmp_path):
    """What a foreground `sess engine up` and the benchmarks do: the program starts again with the
    settings, and in a process that has them the call returns instead of starting it again."""
    plain = {k: v for k, v in os.environ.items() if k not in ENGINE_MALLOC and k != "SESS_MALLOC"}
    script = tmp_path / "probe.py"
    script.write_text(
        "import os, sys\n"
        "from sess.engine.runtime.memory.malloc_tuning import exec_as_engine\n"
        "print('start', flush=True)\n"
        "exec_as_engine([sys.executable, *sys.argv])\n"
        "print(os.environ['MALLOC_ARENA_MAX'], os.environ['MALLOC_MMAP_THRESHOLD_'])\n"
    )
    out = subprocess.run([sys.executable, str(script)], env=plain, capture_output=True, text=True, check=True)
    started = [ENGINE_MALLOC["MALLOC_ARENA_MAX"], ENGINE_MALLOC["MALLOC_MMAP_THRESHOLD_"]]
    assert out.stdout.split() == ["start", "start", *started]  # once as given, once under the settings


def test_sess_malloc_chooses_the_allocator_and_names_what_is_wrong(monkeypatch):
    from sess.engine.runtime.memory import malloc_tuning as memory
    with pytest.raises(ValueError, match="glibc, jemalloc, system"):
        engine_env({"SESS_MALLOC": "tcmalloc"})
    if not sys.platform.startswith("linux"):
        return
    monkeypatch.setattr(memory, "jemalloc_library", lambda: None)
    with pytest.raises(ValueError, match="apt install libjemalloc2"):
        engine_env({"SESS_MALLOC": "jemalloc"})
    monkeypatch.setattr(memory, "jemalloc_library", lambda: "/opt/lib/libjemalloc.so.2")
    env = engine_env({"SESS_MALLOC": "jemalloc", "LD_PRELOAD": "/opt/lib/mine.so"})
    assert env["LD_PRELOAD"] == "/opt/lib/libjemalloc.so.2 /opt/lib/mine.so"
    assert env["MALLOC_CONF"] == memory.JEMALLOC_CONF
    assert not set(ENGINE_MALLOC) & set(env)  # glibc's settings are for glibc's heap
    assert engine_env({"SESS_MALLOC": "jemalloc", "MALLOC_CONF": "narenas:1"})["MALLOC_CONF"] == "narenas:1"


# the trim probe, then which malloc ran it and whether trim() could trim through it
JEMALLOC_PROBE = TRIM_PROBE + "from sess.engine.runtime.memory.malloc_tuning import allocator\nprint(allocator(), trim())\n"


@linux
@pytest.mark.skipif(
    not jemalloc_library(),
    reason="jemalloc is not installed (Debian: apt install libjemalloc2)",
)
def test_an_engine_process_on_jemalloc_uses_it_and_trims_through_it():
    """SESS_MALLOC=jemalloc: the process really runs on jemalloc, and the idle trim purges its
    arenas (decay off here, so only the trim can give the 400 MB back)."""
    env = engine_env(
        {**os.environ, "SESS_MALLOC": "jemalloc", "MALLOC_CONF": "dirty_decay_ms:-1,muzzy_decay_ms:0"}
    )
    out = subprocess.run(
        [sys.executable, "-c", JEMALLOC_PROBE], env=env, capture_output=True, text=True, check=True
    )
    given_back, name, trimmed = out.stdout.split()[-3:]
    assert (name, trimmed) == ("jemalloc", "True")
    assert int(given_back) > 300 * 2**20


def test_the_heap_goes_back_where_the_engine_switches_between_sampling_and_training(
    svc, runtime, monkeypatch
):
    """A trim where sampling gives way to training and the other way round, and not between two
    training ops or two sampling requests (where the pages are reused at once)."""
    import sess.engine.runtime.runtime as runtime_module
    from sess.engine import SamplingParams

    from helpers import SENTENCES, train_steps

    calls = []
    monkeypatch.setattr(runtime_module, "trim", lambda: calls.append(runtime.last_work))
    with svc.create_lora_training_client("tiny-llama", rank=4, seed=3) as tc:
        prompt = tc.get_tokenizer().encode("Once upon a time")
        params = SamplingParams(max_tokens=4, temperature=1.0, seed=1)

        def sample() -> None:
            tc.save_weights_and_get_sampling_client().sample(prompt, 2, params).result()

        sample()
        before = len(calls)  # the session's first work may switch from what earlier tests did
        train_steps(tc, SENTENCES[:2], 1e-3, steps=2)
        assert calls[before:] == ["sample"]  # once, as training begins after sampling
        sample()
        sample()
        assert calls[before:] == ["sample", "train"]
        train_steps(tc, SENTENCES[:2], 1e-3)
        assert calls[before:] == ["sample", "train", "sample"]


# a 12 MB block (a 64-row step's logits on a 49k vocabulary) allocated and freed twice inside
# sampling_heap, then a 40 MB one after it (larger than any free block the heap holds, which glibc
# would otherwise serve first): the bytes malloc holds in mappings of their own (mallinfo2's hblkhd)
# while each one is alive
SAMPLING_HEAP_PROBE = """
import ctypes, torch
from sess.engine.runtime.memory.malloc_tuning import keep_freed_memory, sampling_heap

class Info(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = Info
mapped = lambda: libc.mallinfo2().hblkhd
assert keep_freed_memory("cpu")
seen = []
for _ in range(2):
    with sampling_heap():
        before = mapped()
        x = torch.empty(3 * 2**20).fill_(1.0)
        seen.append(mapped() - before)
        del x
before = mapped()
x = torch.empty(10 * 2**20).fill_(1.0)
seen.append(mapped() - before)
print(*seen)
"""


@linux
def test_a_decode_step_s_big_blocks_come_from_the_heap_and_only_there():
    """Inside sampling_heap a 12 MB block is the heap's (the next step reuses its pages); after it,
    a block from MMAP_FROM that no free heap block fits is mapped on its own again, as training's
    are."""
    plain = {k: v for k, v in os.environ.items() if k not in ENGINE_MALLOC}
    out = subprocess.run(
        [sys.executable, "-c", SAMPLING_HEAP_PROBE], env=plain, capture_output=True, text=True, check=True
    )
    inside_first, inside_again, after = map(int, out.stdout.split()[-3:])
    assert inside_first == inside_again == 0
    assert after >= 40 * 2**20
