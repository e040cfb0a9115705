"""sess Hydra configuration groups."""
