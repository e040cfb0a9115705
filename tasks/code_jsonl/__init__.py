"""The code_jsonl task (see README.md beside this file)."""
