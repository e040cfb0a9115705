"""What a run does on Ctrl-C or SIGTERM (:mod:`.runner` routes both here while its loop trains).

Mid-step, the run finishes that step (a state saved mid-step would not say which updates it holds),
then saves it, records usage and stops the session, within :data:`WIND_DOWN_S`. A second signal
stops the session without finishing the step (the engine saves its state, which a resume uses when
it falls on a recorded step: :mod:`.resumes`), a third quits at once. :class:`Interrupted` then
says the step a ``sess run --resume`` starts from."""

from __future__ import annotations

import contextlib
import shlex
import signal
import threading

from .records import RunRecord
from .recovery import run_usage
from .resumes import STEPS_FILE

WIND_DOWN_S = 60.0  # after Ctrl-C, the most that saving the state and stopping the session may take


class Interrupted(KeyboardInterrupt):
    """Ctrl-C ended the run after saving what it could; ``str()`` is the line telling how to resume."""


@contextlib.contextmanager
def ctrl_c_finishes_the_step(hooks):
    """Route SIGINT, and SIGTERM (what a supervisor or ``kill`` sends), to ``hooks.on_ctrl_c`` while
    the loop trains. Only where Python's own handler is in place: another thread cannot, and a
    process told to ignore or handle a signal otherwise keeps doing so."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    defaults = {signal.SIGINT: signal.default_int_handler, signal.SIGTERM: signal.SIG_DFL}
    routed = [signum for signum, default in defaults.items() if signal.getsignal(signum) is default]
    for signum in routed:
        signal.signal(signum, hooks.on_ctrl_c)
    try:
        yield
    finally:
        for signum in routed:
            signal.signal(signum, defaults[signum])


def wind_down(svc, tc, hooks, record: RunRecord, *, keep_session: bool) -> list[str]:
    """After Ctrl-C: save what was trained since the last save (between steps only), record usage,
    stop the session. In a thread given ``WIND_DOWN_S``, so a stuck engine cannot hold the terminal,
    and a further Ctrl-C (a KeyboardInterrupt in this thread's join) quits at once. Returns what was
    left undone."""
    undone: list[str] = []

    def work() -> None:
        # mid-step, some of the step's updates may have been applied: no step number fits that state
        if hooks is not None and not hooks.mid_step and hooks.done > hooks.last_saved:
            try:
                hooks.save(hooks.done)
            except Exception as exc:
                undone.append(f"saving step {hooks.done} failed ({exc})")
        with contextlib.suppress(Exception):
            record.write_usage(run_usage(svc, record).to_wire())
        if not keep_session:
            try:
                tc.stop()
            except Exception as exc:
                undone.append(
                    f"stopping session {tc.name} failed ({exc}); stop it with `sess stop {tc.name}`"
                )

    if tc is None:  # no session yet: nothing trained, nothing to stop
        return undone
    worker = threading.Thread(target=work, name="sess-wind-down", daemon=True)
    worker.start()
    worker.join(WIND_DOWN_S)
    if worker.is_alive():
        undone.append(f"saving and stopping took over {WIND_DOWN_S:.0f} s; check `sess list` for {tc.name}")
    return undone


def resume_hint(record: RunRecord, undone: list[str]) -> str:
    state, command = record.last_state(), f"sess run --resume {shlex.quote(str(record.path))}"
    recorded = [r["step"] for r in record.rows(STEPS_FILE)]
    if state is None and recorded:  # the engine saved the session's state when it stopped it
        line = (
            f"interrupted after step {max(recorded)}, none saved by the run; {command} continues from "
            "the state the engine saved when it stopped the session, or from the start"
        )
    elif state is None:
        line = "interrupted before its first step was saved; nothing to resume (run the command again)"
    else:
        line = f"interrupted at step {state['step']}; resume with: sess run --resume {shlex.quote(str(record.path))}"
    return "; ".join([line, *undone])
