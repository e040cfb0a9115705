"""Helpers for the Tinker protocol tests: a raw HTTP client of the ``/api/v1`` routes, and a client
environment with the real ``tinker`` SDK in a venv of its own (as on a user's laptop)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np

from sess.engine.server.tinker import schema

TINKER_SDK = "tinker==0.38.0"
# Every tinker release the engine serves (routes.SDK_RANGE) that PyPI has: the cookbook 0.5.x range.
SDK_VERSIONS = ("0.34.0", "0.35.0", "0.36.0", "0.38.0")


class TinkerHttp:
    """The Tinker routes over plain HTTP, as the SDK sends them (protobuf built with the engine's schema)."""

    def __init__(self, url: str, key: str):
        self.url = url
        self.http = httpx.Client(base_url=f"{url}/api/v1", headers={"x-api-key": key}, timeout=120)
        self.sessions: list[str] = []

    def post(self, path: str, body=None, **kw) -> httpx.Response:
        return self.http.post(path, json=body, **kw) if body is not None else self.http.post(path, **kw)

    def ok(self, path: str, body=None, **kw) -> dict:
        response = self.post(path, body, **kw)
        assert response.status_code == 200, (path, response.status_code, response.text[:500])
        return response.json()

    def session(self) -> str:
        body = {"tags": [], "user_metadata": {}, "sdk_version": "0.38.0"}
        self.sessions.append(self.ok("/create_session", body)["session_id"])
        return self.sessions[-1]

    def result(self, request_id: str, *, timeout: float = 120, read_timeout: str = "45"):
        """The future's answer: a dict (JSON) or bytes (protobuf); a failure is {"error", "category"}."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            response = self.http.post(
                "/retrieve_future",
                json={"request_id": request_id, "allow_metadata_only": False},
                headers={"x-stainless-read-timeout": read_timeout},
            )
            assert response.status_code == 200, response.text[:500]
            if response.headers["content-type"].startswith("application/x-protobuf"):
                return response.content
            answer = response.json()
            if answer.get("type") != "try_again":
                return answer
        raise AssertionError(f"future {request_id} did not finish in {timeout} s")

    def create_model(self, session_id: str, seq: int = 0, base_model: str = "tiny-llama", **lora) -> str:
        lora = {"rank": 4, "seed": 0, "train_mlp": True, "train_attn": True, "train_unembed": True, **lora}
        body = {"session_id": session_id, "model_seq_id": seq, "base_model": base_model, "lora_config": lora}
        answer = self.result(self.ok("/create_model", body)["request_id"])
        assert "model_id" in answer, answer
        return answer["model_id"]

    def forward_backward(self, body: bytes, **headers) -> httpx.Response:
        headers = {"content-type": "application/x-protobuf", **headers}
        return self.http.post("/forward_backward", content=body, headers=headers)

    def finish(self, session_id: str) -> None:
        self.ok(f"/sessions/{session_id}/finish", {"reason": {"type": "success"}})

    def close(self) -> None:
        """Finish this client's sessions (their models stop; checkpoints stay) and close."""
        for session in self.sessions:
            self.post(f"/sessions/{session}/finish", {"reason": {"type": "success"}})
        self.http.close()


def fb_request(
    model_id: str, seq: int, sequences: list[list[int]], loss_fn: str = "cross_entropy", **options
) -> bytes:
    """A ``ForwardBackwardRequest`` as the SDK writes it: int32 token bytes, dense little-endian tensors."""
    message = schema.ForwardBackwardRequest(
        model_id=model_id, seq_id=seq, loss_fn=loss_fn, forward_only=options.pop("forward_only", False)
    )
    for key, value in options.pop("config", {}).items():
        message.loss_fn_config[key] = value
        message.loss_fn_config_v2[key].number = value
    for tokens in sequences:
        datum = message.data.add()
        datum.model_input.add().encoded_text.tokens = np.asarray(tokens[:-1], "<i4").tobytes()
        n = len(tokens) - 1
        inputs = {"target_tokens": np.asarray(tokens[1:], "<i8")}
        if loss_fn == "cross_entropy":
            inputs["weights"] = np.ones(n, "<f4")
        else:
            inputs["logprobs"] = np.full(n, -1.0, "<f4")
            inputs["advantages"] = np.ones(n, "<f4")
        for key, array in inputs.items():
            tensor = datum.loss_fn_inputs[key]
            tensor.dense = array.tobytes()
            tensor.dtype = schema.DTYPE["DTYPE_INT64" if array.dtype.kind == "i" else "DTYPE_FLOAT32"]
            tensor.shape.append(n)
    return message.SerializeToString()


def read_fb_output(raw: bytes) -> tuple[list[np.ndarray], dict[str, float]]:
    out = schema.ForwardBackwardOutput()
    out.ParseFromString(raw)
    field = out.loss_fn_outputs[0].fields["logprobs"]
    offsets = np.frombuffer(field.offsets, "<i8")
    data = field.data
    logprobs = [np.frombuffer(data[a:b], "<f4") for a, b in zip(offsets[:-1], offsets[1:])]
    return logprobs, dict(out.metrics)


def self_signed_certificate(directory: Path) -> tuple[str, str]:
    """(certificate, key) PEM files for 127.0.0.1 and localhost, valid one day (needs openssl)."""
    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert)]
        + ["-days", "1", "-subj", "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"],
        check=True,
        capture_output=True,
    )
    return str(cert), str(key)


def make_tinker_venv(root: Path, version: str = TINKER_SDK.split("==")[1]) -> Path:
    """A venv with only the tinker SDK ``version`` (and its dependencies) in it: its python.

    pip runs from this interpreter (``--python``) with ``--no-compile``, so the venv needs no pip
    of its own and skips byte-compiling transformers; the downloads come from pip's cache after
    the first time."""
    venv = root / f"tinker-{version}-venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    pip = [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-compile"]
    subprocess.run(
        pip + [f"tinker=={version}"],
        check=True,
        capture_output=True,
        text=True,
    )
    return python


def make_cookbook_venv(root: Path, extras: str = "math-rl") -> Path:
    """A venv with tinker-cookbook 0.5.8 (and tinker 0.38.0), as a user would install it: its python.
    torch comes first, pinned to the CPU build the machine carries, so the cookbook's torch
    requirement pulls no CUDA wheels; transformers stays at 5.5.4 or older, the releases the
    cookbook 0.5.8 was published against. ``extras``: the cookbook's optional dependency groups."""
    venv = root / "cookbook-venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    pip = [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-compile"]
    for packages in (
        ["torch==2.13.0"],
        [TINKER_SDK, f"tinker-cookbook[{extras}]==0.5.8", "transformers<=5.5.4"],
    ):
        subprocess.run(pip + packages, check=True, capture_output=True, text=True)
    return python


COOKBOOK_061_DEPS = [  # tinker-cookbook 0.6.1's Requires-Dist, but tinker and tml-renderers (below)
    "aiohttp>=3.9.0", "anyio>=4.0.0", "blobfile>=3.0.0", "chz>=0.4.0", "cloudpickle>=3.0.0",
    "datasets>=2.14.0", "huggingface-hub>=0.20.0", "numpy>=1.24.0", "pillow>=10.0.0", "pydantic>=2.0.0",
    "pyrage>=1.4.0", "rich>=13.0.0", "safetensors>=0.4.0", "termcolor>=2.0.0", "tiktoken>=0.12.0",
    "tqdm>=4.60.0", "transformers!=5.3.0,!=5.4.*,!=5.5.0,!=5.5.1,!=5.5.2,!=5.5.3,!=5.6.*,>=4.57.6",
    "math-verify>=0.5.0", "pylatexenc>=2.0", "sympy>=1.12.0",  # its math-rl extra
]  # fmt: skip


def make_cookbook061_venv(root: Path) -> Path:
    """A venv with tinker-cookbook 0.6.1 (tinker 0.38.0), installed the one way it installs: it asks
    for ``tml-renderers>=0.4.1``, which the registry does not serve (newest 0.2.1), so tinker and
    tml-renderers 0.2.1 first, then the cookbook without its dependencies, then the rest of them
    (and its math-rl extra). Its python."""
    venv = root / "cookbook061-venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    pip = [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-compile"]
    for packages in (
        ["torch==2.13.0"],
        [TINKER_SDK, "tml-renderers==0.2.1", *COOKBOOK_061_DEPS],
        ["--no-deps", "tinker-cookbook==0.6.1"],
    ):
        subprocess.run(pip + packages, check=True, capture_output=True, text=True)
    return python


def run_client(
    python: Path, script: str, spec: dict, *, url: str, key: str, timeout: float = 300, env=None
) -> dict:
    """Run ``script`` (a file in tests/tinker_scripts) under the SDK venv with ``spec`` as its input;
    its JSON output."""
    here = Path(__file__).parent / "tinker_scripts"
    out = Path(spec["out"])
    environment = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("TINKER_", "SESS_"))},
        "TINKER_API_KEY": key,
        "TINKER_BASE_URL": url,
        "TINKER_TELEMETRY": "0",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        **(env or {}),
    }
    done = subprocess.run(
        [str(python), str(here / script), json.dumps(spec)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=environment,
    )
    assert done.returncode == 0, f"{script} failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    return json.loads(out.read_text())


class DroppingProxy:
    """An HTTP/1.1 reverse proxy to the engine that, for each path in ``drop``, forwards the first
    request and then closes the client's connection instead of answering: a connection lost after
    the engine got the request, which the SDK answers by sending it again."""

    def __init__(self, upstream: str, drop: set[str]):
        import asyncio
        import threading

        self.upstream, self.drop = upstream, set(drop)
        self.seen: dict[str, int] = {}
        self._loop = asyncio.new_event_loop()
        started = threading.Event()

        async def serve() -> None:
            self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
            self.url = f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"
            started.set()

        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        asyncio.run_coroutine_threadsafe(serve(), self._loop)
        started.wait(10)

    async def _handle(self, reader, writer) -> None:
        async with httpx.AsyncClient(base_url=self.upstream, timeout=120) as client:
            try:
                while True:
                    head = await reader.readuntil(b"\r\n\r\n")
                    lines = head.decode("latin-1").split("\r\n")
                    method, target, _ = lines[0].split(" ", 2)
                    headers = [tuple(line.split(": ", 1)) for line in lines[1:] if ": " in line]
                    length = next((int(v) for k, v in headers if k.lower() == "content-length"), 0)
                    body = await reader.readexactly(length) if length else b""
                    keep = [
                        (k, v)
                        for k, v in headers
                        if k.lower() not in ("host", "content-length", "connection")
                    ]
                    response = await client.request(method, target, content=body, headers=keep)
                    path = target.split("?", 1)[0]
                    self.seen[path] = self.seen.get(path, 0) + 1
                    if path in self.drop:
                        self.drop.discard(path)
                        break  # the engine ran it; the client never hears back
                    skip = ("content-length", "transfer-encoding", "content-encoding", "connection")
                    out = [f"HTTP/1.1 {response.status_code} {response.reason_phrase}"]
                    out += [f"{k}: {v}" for k, v in response.headers.items() if k.lower() not in skip]
                    out += [f"content-length: {len(response.content)}", "", ""]
                    writer.write("\r\n".join(out).encode("latin-1") + response.content)
                    await writer.drain()
            except Exception:  # the client closed its connection (or we drop it)
                pass
            finally:
                writer.close()

    def close(self) -> None:
        """Stop serving and end every connection's handler on the proxy's loop (a connection that
        arrived last may not have started its handler yet: cancelled and awaited, not dropped)."""
        import asyncio

        async def shut() -> None:
            self._server.close()
            handlers = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in handlers:
                task.cancel()
            await asyncio.gather(*handlers, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(shut(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        self._loop.close()
