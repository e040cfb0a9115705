"""The code task (see README.md beside this file)."""
