"""The gsm8k task (see README.md beside this file)."""
