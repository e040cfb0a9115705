"""Fair queues: the ready queue's order (per session as queued, across keys by engine time, idle keys
banking no credit) and, on a real executor with tiny-llama, a light key's op overtaking another
key's flood of forward_backward calls, where arrival order makes it wait for all of them; a burst of
sample requests reaching an idle engine taken as one prefill."""

from __future__ import annotations

import time
from types import SimpleNamespace

import numpy as np
import pytest

from sess.engine.protocol import requests as rq
from sess.engine.protocol.types import Datum, ModelInput
from sess.engine.runtime.executor import Executor
from sess.engine.runtime.fair_queue import ReadyQueue


def op(owner: str, session: str | None, label: str):
    return SimpleNamespace(owner=owner, session=session, label=label)


def drain(queue: ReadyQueue, charge: dict[str, float] | None = None) -> list[str]:
    order = []
    while queue:
        item = queue.popleft()
        order.append(item.label)
        queue.charge(item.owner, (charge or {}).get(item.owner, 1.0))
    return order


def test_a_sessions_ops_keep_their_order_and_a_keys_sessions_take_turns():
    queue = ReadyQueue()
    for label in ("a1", "a2", "a3"):
        queue.append(op("k", "a", label))
    for label in ("b1", "b2"):
        queue.append(op("k", "b", label))
    assert drain(queue) == ["a1", "b1", "a2", "b2", "a3"]


def test_a_light_key_waits_behind_one_heavy_op_not_the_queue():
    queue = ReadyQueue()
    for i in range(50):
        queue.append(op("heavy", "h", f"h{i}"))
    first = queue.popleft()
    queue.charge(first.owner, 2.0)  # the heavy op that was running when the light one arrived
    queue.append(op("light", "l", "light"))
    assert queue.popleft().label == "light"
    # and over time each key gets its share of engine time: heavy ops cost 4x the light ones
    for i in range(20):
        queue.append(op("light", "l", f"l{i}"))
    order = drain(queue, {"heavy": 4.0, "light": 1.0})
    heavy_in_first_20 = sum(x.startswith("h") for x in order[:20])
    assert 3 <= heavy_in_first_20 <= 5  # 4 s per heavy op, 1 s per light one: about 1 in 5


def test_an_idle_key_banks_no_credit():
    queue = ReadyQueue()
    for i in range(5):
        queue.append(op("busy", "s", f"b{i}"))
    for _ in range(3):
        queue.charge("busy", 10.0)
        queue.popleft()
    queue.append(op("late", "t", "late1"))
    queue.append(op("late", "t", "late2"))
    queue.append(op("late", "t", "late3"))
    # the late key starts level with the busy one, not 30 s behind it: they alternate
    assert drain(queue, {"busy": 1.0, "late": 1.0})[:4] in (
        ["late1", "b3", "late2", "b4"],
        ["b3", "late1", "b4", "late2"],
    )


def test_arrival_order_and_taking_sample_requests_out():
    queue = ReadyQueue(fair=False)
    labels = ["h1", "h2", "s1", "l1", "s2"]
    for label in labels:
        queue.append(op("light" if label[0] == "l" else "heavy", label[0], label))
    taken = queue.take(lambda o: o.label.startswith("s"))
    assert [o.label for o in taken] == ["s1", "s2"] and len(queue) == 3
    assert drain(queue) == ["h1", "h2", "l1"]
    fair = ReadyQueue()
    for label in labels:
        fair.append(op("light" if label[0] == "l" else "heavy", label[0], label))
    assert [o.label for o in fair.take(lambda o: o.label.startswith("s"))] == ["s1", "s2"]
    assert sorted(drain(fair)) == ["h1", "h2", "l1"] and not fair


def _batch(n: int, length: int) -> dict:
    rng = np.random.default_rng(0)
    data = []
    for _ in range(n):
        tokens = rng.integers(3, 200, length + 1)
        data.append(
            Datum(
                model_input=ModelInput.from_ints(tokens[:-1].tolist()),
                loss_fn_inputs={"target_tokens": tokens[1:], "weights": np.ones(length, np.float32)},
            )
        )
    return rq.ForwardRequest(session="", data=data).to_wire()


@pytest.mark.parametrize("fair", [True, False])
def test_a_light_keys_op_overtakes_a_flood_only_with_fair_queues(tmp_path, fair):
    executor = Executor(tmp_path, fair=fair)
    try:
        for owner in ("heavy", "light"):
            executor.call(owner, "create_session", {"base_model": "tiny-llama", "name": owner, "rank": 4})
        heavy, light = _batch(4, 128), _batch(1, 8)
        flood = [
            executor.submit("heavy", "forward_backward", heavy, session="heavy", seq=i + 1) for i in range(8)
        ]
        time.sleep(0.05)  # the flood is queued before the light op arrives
        quick = executor.submit("light", "forward", light, session="light", seq=1)
        done_at_arrival = sum(executor.wait("heavy", f, timeout=0) is not None for f in flood)
        light_op = executor.wait("light", quick, timeout=300)
        assert light_op is not None and light_op.error is None
        done_before = sum(executor.wait("heavy", f, timeout=0) is not None for f in flood)
        for f in flood:
            assert executor.wait("heavy", f, timeout=300).error is None
    finally:
        executor.close()
    assert done_at_arrival <= 4, done_at_arrival  # most of the flood was still queued
    if fair:
        # the one running when it arrived (and maybe the next)
        assert done_before - done_at_arrival <= 2, (done_at_arrival, done_before)
    else:
        assert done_before == 8


def test_a_burst_of_sample_requests_on_an_idle_engine_prefills_together(tmp_path, monkeypatch):
    """Requests sent one after another (a loop's prompts) reach an idle decode batch as one join,
    not the first alone and the rest after it (a second prefill and a copy of the cache)."""
    from sess.engine.runtime import fair_queue as fair_queue_module
    from sess.engine.sampling.decode_batch import DecodeBatch

    # a wide quiet window, so that a loaded machine's scheduling cannot split the burst
    monkeypatch.setattr(fair_queue_module, "BURST_QUIET_S", 0.5)
    monkeypatch.setattr(fair_queue_module, "BURST_MAX_S", 5.0)
    joins: list[int] = []
    join = DecodeBatch._join

    def counted(self, jobs):
        joins.append(len(jobs))
        return join(self, jobs)

    monkeypatch.setattr(DecodeBatch, "_join", counted)
    executor = Executor(tmp_path)
    try:
        target = {"base_model": "tiny-llama"}
        params = {"max_tokens": 4, "temperature": 1.0, "seed": 0}
        warm = executor.submit("me", "sample", {"target": target, "prompt": [5], "sampling_params": params})
        assert executor.wait("me", warm, timeout=300).error is None
        joins.clear()
        burst = []
        for i in range(4):
            request = {"target": target, "prompt": [5 + i, 6, 7], "num_samples": 2, "sampling_params": params}
            burst.append(executor.submit("me", "sample", request))
            time.sleep(0.05)  # far longer than the executor takes to wake and start a prefill
        for op_id in burst:
            assert executor.wait("me", op_id, timeout=300).error is None
    finally:
        executor.close()
    assert joins == [4]
