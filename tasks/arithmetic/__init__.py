"""The arithmetic task (see README.md beside this file)."""
