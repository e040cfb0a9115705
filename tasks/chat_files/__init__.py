"""The chat_files task (see README.md beside this file)."""
