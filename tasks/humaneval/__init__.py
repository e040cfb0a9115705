"""The humaneval task (see README.md beside this file)."""
