"""The vLLM worker: a process of its own, run by the Python of an environment that has vLLM.

vLLM pins its own torch and transformers, so the engine does not import it: it starts this script
with that environment's interpreter (``sess engine up --sampler vllm --sampler-python PATH``) and
speaks JSON lines with it over the worker's stdin and a private copy of its stdout (whatever vLLM
prints goes to stderr). The script imports nothing of sess.

Lines from the engine, one JSON object each:
``{"op": "load", "model": DIR, "dtype": ..., "max_lora_rank": R, "max_loras": N, "max_model_len": L}``
loads the base model once (answered ``{"event": "loaded", "seconds": S}``);
``{"op": "sample", "id": ID, "prompt": [ids], "n": K, "params": {...}, "lora": {"id", "name",
"path"} | null}`` samples K sequences through the PEFT adapter at ``path`` (loaded by vLLM once per
id), answered ``{"id": ID, "sequences": [{"tokens", "logprobs", "stop_reason"}]}`` or ``{"id": ID,
"error": MESSAGE}``; ``{"op": "close"}`` ends the worker. On start it announces
``{"event": "ready", "vllm": VERSION, "architectures": [...]}``: the model classes it can serve.
Requests run together: the worker adds each one to vLLM's engine as it arrives and steps the engine
while any is unfinished (continuous batching), so a request never waits for another to end.
"""

from __future__ import annotations

import json
import os
import queue
import sys
import threading
import time


def _protocol_out():
    """The real stdout for protocol lines; fd 1 becomes stderr so library prints cannot corrupt it."""
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return out


def _reader(lines: queue.Queue) -> None:
    for line in sys.stdin:
        if line.strip():
            lines.put(json.loads(line))
    lines.put({"op": "close"})  # the engine went away


def _sampling_params(vllm, n: int, params: dict):
    from vllm.sampling_params import RequestOutputKind

    stop = params.get("stop")
    no_eos = stop == []  # an empty list turns EOS off too (None keeps it): the Tinker SDK's meaning
    stop = [stop] if isinstance(stop, str) else list(stop or [])
    return vllm.SamplingParams(
        ignore_eos=no_eos,
        n=n,
        max_tokens=params["max_tokens"],
        temperature=params["temperature"],
        top_p=params["top_p"],
        top_k=params["top_k"] if params["top_k"] > 0 else 0,
        seed=params.get("seed"),
        stop=[s for s in stop if isinstance(s, str)] or None,
        stop_token_ids=[s for s in stop if isinstance(s, int)] or None,
        logprobs=0,  # the sampled token's own logprob (vLLM's raw logprobs: temperature 1, untruncated)
        output_kind=RequestOutputKind.FINAL_ONLY,
    )


def _sequence(completion) -> dict:
    tokens = list(completion.token_ids)
    logprobs = [float(step[token].logprob) for step, token in zip(completion.logprobs, tokens)]
    return {
        "tokens": tokens,
        "logprobs": logprobs,
        "stop_reason": "length" if completion.finish_reason == "length" else "stop",
    }


def main() -> None:
    out = _protocol_out()

    def send(obj: dict) -> None:
        out.write(json.dumps(obj) + "\n")

    import vllm
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest
    from vllm.model_executor.models import ModelRegistry

    send(
        {
            "event": "ready",
            "vllm": vllm.__version__,
            "architectures": sorted(ModelRegistry.get_supported_archs()),
        }
    )
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=_reader, args=(lines,), daemon=True).start()
    engine = None
    greedy_copies: dict[str, int] = {}  # request id -> rows asked for, where one greedy row is sampled
    while True:
        busy = engine is not None and engine.has_unfinished_requests()
        try:
            message = lines.get(block=not busy)
        except queue.Empty:
            message = None
        if message is not None:
            op = message.get("op")
            if op == "close":
                return
            if op == "load":
                start = time.perf_counter()
                try:
                    llm = vllm.LLM(
                        model=message["model"],
                        dtype=message["dtype"],
                        enable_lora=True,
                        max_lora_rank=message["max_lora_rank"],
                        max_loras=message["max_loras"],
                        max_model_len=message["max_model_len"],
                        gpu_memory_utilization=message["gpu_memory_utilization"],
                        seed=0,
                    )
                    # one token through every kernel: a model or shape vLLM loads but cannot run
                    # (a CPU attention head size, say) fails here, at load, not at the first request
                    llm.generate([TokensPrompt(prompt_token_ids=[0, 1])], vllm.SamplingParams(max_tokens=1))
                except Exception as exc:  # noqa: BLE001 - the engine reports it, naming the model
                    send({"event": "error", "message": f"{type(exc).__name__}: {exc}"})
                    continue
                engine = llm.llm_engine
                send({"event": "loaded", "seconds": time.perf_counter() - start})
            elif op == "sample":
                lora = message.get("lora")
                n, params = message["n"], message["params"]
                # vLLM refuses n > 1 when greedy; greedy rows are all the same, so one is sampled
                if params["temperature"] == 0 and n > 1:
                    greedy_copies[message["id"]], n = n, 1
                try:
                    engine.add_request(
                        message["id"],
                        TokensPrompt(prompt_token_ids=message["prompt"]),
                        _sampling_params(vllm, n, params),
                        lora_request=LoRARequest(lora["name"], lora["id"], lora["path"]) if lora else None,
                    )
                except Exception as exc:  # noqa: BLE001 - one bad request fails alone
                    send({"id": message["id"], "error": f"{type(exc).__name__}: {exc}"})
            continue
        try:
            outputs = engine.step()
        except Exception as exc:  # noqa: BLE001 - the engine cannot go on; say why, then stop
            send({"event": "error", "message": f"vLLM step failed: {type(exc).__name__}: {exc}"})
            return
        for output in outputs:
            if output.finished:
                sequences = [_sequence(c) for c in output.outputs]
                sequences *= greedy_copies.pop(output.request_id, 1)
                send({"id": output.request_id, "sequences": sequences})


if __name__ == "__main__":
    main()
