"""`python -m sess.sandbox.server`'s `/run_code` with SandboxFusion's `files` and `fetch_files`, over HTTP.

Files go into the run's working directory (and are importable from it), fetched files come back
base64, hostile names and contents are refused with a SandboxFusion-shaped error that names the file,
and the server serves the next request as before; the run keeps its time, output and memory limits
with files and fetching. sess's own `SandboxFusionGrader` sends the fields tinker-cookbook's
`SandboxFusionClient` sends. The cookbook's own grader against this server: test_cookbook_code_grading.py.
"""

from __future__ import annotations

import base64
import http.server
import json
import socket
import threading
import urllib.request

import pytest

from sess.sandbox import GradeJob, Limits, SandboxFusionGrader

from helpers import sandbox_server


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def _post(url: str, body: dict) -> dict:
    request = urllib.request.Request(
        url + "/run_code", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=60) as reply:
        return json.loads(reply.read())


@pytest.fixture(scope="module")
def url():
    with sandbox_server(4) as url:
        yield url


def test_files_are_in_the_working_directory_and_fetch_files_come_back(url):
    code = (
        "import os, helper\n"
        "print(helper.X, open('data/in.txt').read(), sorted(os.listdir('.')))\n"
        "open('out.txt', 'w').write('written ' + input())\n"
        "open('data/in.txt', 'a').write(' again')\n"
        "os.symlink('/etc/ld.so.cache', 'link')\n"
        "os.mkfifo('pipe')\n"
    )
    files = {"helper.py": _b64("X = 41"), "data/in.txt": _b64("hello"), "empty.txt": None}
    fetch = ["out.txt", "data/in.txt", "link", "pipe", "missing.txt"]
    reply = _post(
        url,
        {
            "code": code,
            "language": "python",
            "run_timeout": 4,
            "stdin": "now\n",
            "files": files,
            "fetch_files": fetch,
        },
    )
    assert set(reply) >= {"status", "message", "compile_result", "run_result", "files"}
    run = reply["run_result"]
    assert set(run) >= {"status", "execution_time", "return_code", "stdout", "stderr"}
    assert reply["status"] == "Success" and run["status"] == "Finished" and run["return_code"] == 0, reply
    listing = "['__run_code__.py', 'data', 'empty.txt', 'helper.py']"
    assert run["stdout"] == f"41 hello {listing}\n"  # the fetch report is not in stdout
    fetched = {name: base64.b64decode(data).decode() for name, data in reply["files"].items()}
    assert fetched == {"out.txt": "written now", "data/in.txt": "hello again"}
    # a link is not followed, a fifo not opened, a missing file not invented: each named
    for words in (
        "link: a symbolic link, not followed",
        "pipe: not a regular file",
        "missing.txt: No such file",
    ):
        assert words in reply["message"], reply["message"]


@pytest.mark.parametrize(
    ("files", "fetch", "words"),
    [
        ({"/etc/passwd": _b64("x")}, [], "file '/etc/passwd' is an absolute path"),
        ({"a/../../x": _b64("x")}, [], "file 'a/../../x' climbs out"),
        (
            {"__run_code__.py": _b64("print(2)")},
            [],
            "file '__run_code__.py' would replace the request's code",
        ),
        ({"ok.txt": _b64("x"), "bad.txt": "not base64!"}, [], "file 'bad.txt' is not valid base64"),
        ({f"f{i}": "" for i in range(10_000)}, [], "10000 files, over the limit of 64"),
        ({"big.bin": _b64("x" * (33 << 20))}, [], "file 'big.bin' is over the 33554432-byte limit"),
        ({"a": _b64("1"), "a/b": _b64("2")}, [], "file 'a/b' needs 'a' as a directory"),
        ({".bashrc": ""}, [], "file '.bashrc' is not a plain relative path"),
        ({"a\\..\\b": ""}, [], "is not a plain relative path"),
        ({"x": 7}, [], "file 'x' must have base64 text"),
        ({}, ["/etc/shadow"], "fetch_files: file '/etc/shadow' is an absolute path"),
        ({}, ["../secret"], "fetch_files: file '../secret' climbs out"),
    ],
)
def test_hostile_files_are_refused_naming_the_file_and_the_server_serves_on(url, files, fetch, words):
    reply = _post(url, {"code": "print(1)", "language": "python", "files": files, "fetch_files": fetch})
    assert reply["status"] == "SandboxError" and words in reply["message"], reply["message"][:300]
    assert reply["run_result"] is None  # refused before anything ran
    after = _post(url, {"code": "print(input()[::-1])", "language": "python", "stdin": "abc\n"})
    assert after["status"] == "Success" and after["run_result"]["stdout"] == "cba\n"


def test_a_body_over_the_servers_limit_is_a_413_in_sandboxfusions_shape(url):
    # refused on its Content-Length, before the server reads (or the client sends) the body
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as connection:
        head = "POST /run_code HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        connection.sendall(f"{head}Content-Length: {90 << 20}\r\n\r\n".encode())
        reply = b""
        while b"}" not in reply:
            reply += connection.recv(65536)
    status, _, body = reply.partition(b"\r\n\r\n")
    assert status.startswith(b"HTTP/1.1 413")
    answer = json.loads(body)
    assert answer["status"] == "SandboxError" and "over the server's" in answer["message"]
    assert _post(url, {"code": "print(2)", "language": "python"})["run_result"]["stdout"] == "2\n"


def test_limits_hold_with_files_and_fetching(url):
    files, fetch = {"x.txt": _b64("x")}, ["x.txt"]
    spin = _post(
        url, {"code": "while True: pass", "language": "python", "files": files, "fetch_files": fetch}
    )
    assert spin["status"] == "Failed" and spin["run_result"]["status"] == "TimeLimitExceeded"
    sleep = _post(
        url,
        {"code": "import time\ntime.sleep(60)", "language": "python", "files": files, "fetch_files": fetch},
    )
    assert sleep["run_result"]["status"] == "TimeLimitExceeded" and sleep["run_result"]["execution_time"] < 10
    loud = _post(
        url, {"code": "print('x' * (3 << 20))", "language": "python", "files": files, "fetch_files": fetch}
    )
    assert loud["status"] == "Failed" and loud["message"].startswith("output limit"), loud["message"]
    greedy = "b = bytearray(900 << 20)\nprint('allocated')"
    memory = _post(url, {"code": greedy, "language": "python", "files": files, "fetch_files": fetch})
    assert memory["status"] == "Failed" and "MemoryError" in memory["run_result"]["stderr"]
    fill = "open('big', 'wb').write(b'x' * (100 << 20))"  # more than the run's 64 MB tmpfs
    disk = _post(url, {"code": fill, "language": "python", "files": files, "fetch_files": ["big"]})
    assert disk["status"] == "Failed" and "No space left" in disk["run_result"]["stderr"]
    fetch_all = "open('big', 'wb').write(b'x' * (2 << 20))"  # more than the fetch budget (output_bytes)
    over = _post(url, {"code": fetch_all, "language": "python", "fetch_files": ["big"]})
    assert (
        over["status"] == "Success" and over["files"] == {} and "big: 2097152 bytes, over" in over["message"]
    )


class _Recorder(http.server.BaseHTTPRequestHandler):
    bodies: list[dict] = []

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        _Recorder.bodies.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
        answer = json.dumps(
            {
                "status": "Success",
                "message": "",
                "run_result": {"status": "Finished", "return_code": 0, "stdout": "", "stderr": ""},
                "files": {},
            }
        ).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    def log_message(self, *args) -> None:
        pass


def test_sess_grader_sends_the_fields_the_cookbook_client_sends():
    # tinker-cookbook 0.5.8 SandboxFusionClient.run: {"code", "language", "run_timeout", "files"}
    server = http.server.HTTPServer(("127.0.0.1", 0), _Recorder)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        with SandboxFusionGrader(url, limits=Limits(wall_s=3)) as grader:
            grader.grade(GradeJob("x = 1", "assert x == 1"))
    finally:
        server.shutdown()
    (body,) = _Recorder.bodies
    assert {"code", "language", "run_timeout", "files"} <= set(body)
    assert body["language"] == "python" and body["run_timeout"] == 3 and body["files"] == {}
    assert body["fetch_files"] == [] and isinstance(body["stdin"], str)
