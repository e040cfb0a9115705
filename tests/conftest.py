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
def svc(sess_home):
    from sess.engine import ServiceClient

    client = ServiceClient("inproc", home=sess_home)
    yield client
    client.close()


@pytest.fixture(scope="session")
def runtime(svc):
    """The in-process runtime behind ``svc``: lets tests read gradients the SDK does not expose."""
    return svc.transport.engine.runtime
