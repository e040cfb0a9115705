"""sess client-side loops."""
