"""The user_env task (see README.md beside this file)."""
