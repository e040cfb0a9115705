"""Helpers shared by the benchmark scripts.

Why baselines run in their own thread: torch's CPU kernels run on an OpenMP thread team that
belongs to the thread calling them, and a team's workers outlive the call. The in-process engine
computes on its executor thread; if the script's main thread also ran torch kernels, two teams
would share the cores, and on a small machine (2 cores here) every parallel region of either
then waits for a sleeping worker to be woken: both sides measured 1.3-2x slower than alone. A
baseline run in a short-lived thread takes its team with it when the thread ends.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def in_own_thread(fn: Callable[..., T], *args, **kwargs) -> T:
    """``fn(*args, **kwargs)`` on a fresh thread, whose OpenMP team ends with it."""
    result: list = []
    error: list[BaseException] = []

    def target() -> None:
        try:
            result.append(fn(*args, **kwargs))
        except BaseException as exc:  # handed back to the caller below
            error.append(exc)

    thread = threading.Thread(target=target, name="baseline")
    thread.start()
    thread.join()
    if error:
        raise error[0]
    return result[0]
