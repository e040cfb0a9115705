"""The needle-in-a-haystack task (see README.md beside this file)."""
