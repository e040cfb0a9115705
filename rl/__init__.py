"""RL machinery the loops are built from: the env interface, rollouts and their workers, rendering, evaluation."""
