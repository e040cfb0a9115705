"""Tasks: one folder per task (its data, env and reward), and the ``data=`` table of them (:mod:`.sources`)."""
