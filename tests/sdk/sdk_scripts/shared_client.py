"""Run in a fresh interpreter (see tests/test_sdk_threads.py): one ServiceClient shared by N threads,
then by N asyncio tasks, each with a training session of its own on tiny-llama. Writes what each
worker saw, and every error, as JSON to argv[3]."""

import asyncio
import json
import sys
import threading
import traceback

from sess.engine import AdamParams, SamplingParams, ServiceClient

url, n, out_path = sys.argv[1], int(sys.argv[2]), sys.argv[3]
svc = ServiceClient(url)  # SESS_API_KEY: a key with room for 2 * n sessions
ADAM = AdamParams(learning_rate=5e-2)
report: dict = {"threads": {}, "tasks": {}, "errors": []}


def summary(i, fb1, opt1, probe, fb2, opt2, tc, sampled) -> dict:
    return {
        "losses": [fb1.metrics["loss:sum"], probe.metrics["loss:sum"], fb2.metrics["loss:sum"]],
        "optim": [bool(opt1.metrics), bool(opt2.metrics)],
        "seq": tc.current_sequence_number,
        "sampled": len(sampled.sequences[0].tokens),
    }


def in_thread(i: int, barrier: threading.Barrier) -> None:
    try:
        tc = svc.create_lora_training_client("tiny-llama", rank=2, seed=i)
        barrier.wait(60)  # every thread loads its tokenizer at the same moment
        tokens = tc.get_tokenizer().encode(f"worker {i} counts {i + 1} {i + 2} {i + 3}")
        # fb, optim, a probe forward, fb, optim: the probe sees the first step's weights only if the
        # session's ops ran in the order they were made
        futures = [
            tc.forward_backward([tokens]),
            tc.optim_step(ADAM),
            tc.forward([tokens]),
            tc.forward_backward([tokens]),
            tc.optim_step(ADAM),
        ]
        results = [f.result(timeout=300) for f in futures]
        sc = tc.save_weights_and_get_sampling_client()
        sampled = sc.sample(tokens[:4], 1, SamplingParams(max_tokens=3, seed=i)).result(timeout=300)
        report["threads"][i] = summary(i, *results, tc, sampled)
        tc.stop()
    except BaseException:
        barrier.abort()  # the others fail at once instead of waiting for this one
        report["errors"].append(f"thread {i}: {traceback.format_exc()[-1500:]}")


async def in_task(i: int) -> None:
    try:
        tc = await asyncio.to_thread(svc.create_lora_training_client, "tiny-llama", rank=2, seed=100 + i)
        tokenizer = await asyncio.to_thread(tc.get_tokenizer)
        tokens = tokenizer.encode(f"task {i} counts {i + 1} {i + 2}")
        fb1 = await tc.forward_backward_async([tokens])
        opt1 = await tc.optim_step_async(ADAM)
        probe = await tc.forward_async([tokens])
        fb2 = await tc.forward_backward_async([tokens])
        opt2 = await tc.optim_step_async(ADAM)
        results = [await f for f in (fb1, opt1, probe, fb2, opt2)]
        sc = await asyncio.to_thread(tc.save_weights_and_get_sampling_client)
        sampled = await (await sc.sample_async(tokens[:4], 1, SamplingParams(max_tokens=3, seed=i)))
        report["tasks"][i] = summary(i, *results, tc, sampled)
        await asyncio.to_thread(tc.stop)
    except BaseException:
        report["errors"].append(f"task {i}: {traceback.format_exc()[-1500:]}")


barrier = threading.Barrier(n)
threads = [threading.Thread(target=in_thread, args=(i, barrier)) for i in range(n)]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join(600)


async def all_tasks() -> None:
    await asyncio.gather(*(in_task(i) for i in range(n)))


asyncio.run(all_tasks())
svc.close()
with open(out_path, "w") as f:
    json.dump(report, f)
