"""``python -m sess.harness loop=grpo model=tiny-llama loop.steps=2``: a run as ``sess run`` makes it.

The same composed config, run directory and records, without the CLI (:func:`.runner.main`).
"""

from sess.harness.runner import main

main()
