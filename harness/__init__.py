"""The run harness: config composition, the loop registry, the runner, run records, progress and Ctrl-C."""
