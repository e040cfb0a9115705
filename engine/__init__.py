"""sess engine and SDK."""
