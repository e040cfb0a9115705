"""``sess attach NAME``: a Python REPL (IPython when installed) bound to a live session.

``tc`` is the session's TrainingClient, ``sc`` a SamplingClient of its current weights, ``tok`` its
tokenizer, ``svc`` the ServiceClient, and the SDK's names are imported. Without IPython the standard
REPL gets readline history (``~/.sess/attach_history``) and tab completion of those names.
``-c CODE`` runs a snippet in the same namespace and exits, for scripts and pipelines. Attaching never
starts an engine: with none running it says how to start one.
"""

from __future__ import annotations

import typer

from sess.cli.app import app, fail, guard
from sess.cli.session_cmds import known_session, reader

BANNER = """sess attach: session {name} on {base_model} ({url})
  tc   TrainingClient of the live session   tc.forward_backward(data), tc.optim_step(AdamParams(...))
  sc   SamplingClient of its current weights sc.sample(tok.encode("..."), 1, SamplingParams(max_tokens=32))
  tok  its tokenizer; svc the ServiceClient; SDK types imported (Datum, ModelInput, TensorData, ...)
Ctrl-D leaves the REPL; the session keeps running."""


@app.command()
def attach(
    name: str = typer.Argument(..., help="A live session's name (see `sess list`)."),
    code: str = typer.Option(
        None, "-c", "--code", help="Run this Python code in the session's namespace and exit."
    ),
    plain: bool = typer.Option(
        False, "--plain", help="The standard Python REPL even where IPython is installed."
    ),
    url: str = typer.Option(
        None, "--url", help="Engine URL (default: the local engine, which must be running)."
    ),
    api_key: str = typer.Option(None, "--api-key", help="API key for a remote engine."),
) -> None:
    """Open a Python REPL bound to a live session (or run -c CODE in it)."""
    import sess.engine as sdk
    from sess.harness.config import engine_url_problem

    if url not in (None, "inproc", "local") and (problem := engine_url_problem(url)):  # the SDK's own two
        fail(f"--url: {problem}")
    svc = reader(url, api_key)
    summary = known_session(svc, name)
    if summary.status.value != "Running":
        fail(
            f"session {name!r} is {summary.status.value} at step {summary.step}; `sess resume {name}` "
            f"continues it under the same name, then `sess attach {name}` works"
        )
    tc = guard(svc.get_training_client, name)
    namespace = {k: getattr(sdk, k) for k in sdk.__all__}
    namespace.update(svc=svc, tc=tc, sc=tc.create_sampling_client(), tok=tc.get_tokenizer())
    if code is not None:
        exec(compile(code, "<sess attach -c>", "exec"), namespace)  # noqa: S102 - the user's own code
        return
    banner = BANNER.format(name=tc.name, base_model=tc.base_model, url=svc.url)
    if not plain and _ipython(banner, namespace):
        return
    _standard_repl(banner, namespace)


def _ipython(banner: str, namespace: dict) -> bool:
    """IPython's shell on ``namespace``; False when IPython is not installed."""
    try:
        from IPython.terminal.embed import InteractiveShellEmbed
    except ImportError:
        return False
    InteractiveShellEmbed(banner1=banner + "\n", exit_msg="", user_ns=namespace)()
    return True


def _standard_repl(banner: str, namespace: dict) -> None:
    """Python's own REPL with readline history and tab completion on ``namespace``."""
    import code
    import os
    from pathlib import Path

    try:
        import readline
        import rlcompleter

        readline.set_completer(rlcompleter.Completer(namespace).complete)
        readline.parse_and_bind("tab: complete")
        history = Path(os.environ.get("SESS_HOME") or Path.home() / ".sess") / "attach_history"
        history.parent.mkdir(parents=True, exist_ok=True)
        if history.exists():
            readline.read_history_file(history)
        readline.set_history_length(2000)
    except (ImportError, OSError):  # no readline on this platform: the plain REPL still works
        history = None
    try:
        code.interact(banner=banner, local=namespace, exitmsg="")
    finally:
        if history is not None:
            try:
                readline.write_history_file(history)
            except OSError:
                pass
