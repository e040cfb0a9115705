"""sess command-line interface."""
