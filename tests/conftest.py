"""Shared fixtures: one engine home per test run (tiny models materialise once) and SDK clients."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def sess_home(tmp_path_factory):
    home = tmp_path_factory.mktemp("sess-home")
    old = os.environ.get("SESS_HOME")
    os.environ["SESS_HOME"] = str(home)
    yield home
    if old is None:
        os.environ.pop("SESS_HOME", None)
    else:
        os.environ["SESS_HOME"] = old


@pytest.fixture(scope="session")
def http_engine(sess_home):
    """An engine server in its own process on the test home (``python -m sess.engine.server``)."""
    from sess.engine.server.launcher import start_engine, stop_engine

    info = start_engine(sess_home)
    yield info
    stop_engine(sess_home)


@pytest.fixture(scope="session", params=["inproc", "http"])
def svc(request, sess_home):
    """The SDK over each transport: every test using it runs in-process and against a server."""
    from sess.engine import ServiceClient

    if request.param == "inproc":
        client = ServiceClient("inproc", home=sess_home)
    else:
        client = ServiceClient(request.getfixturevalue("http_engine")["url"], home=sess_home)
    yield client
    client.close()


@pytest.fixture(scope="session")
def runtime(svc):
    """The in-process runtime behind ``svc``: lets tests read gradients the SDK does not expose."""
    if not hasattr(svc.transport, "engine"):
        pytest.skip("reads the in-process runtime; runs with the inproc transport")
    return svc.transport.engine.runtime
