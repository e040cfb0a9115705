"""The runtime layer: the executor thread and everything it runs on torch.

Sessions and their ops, losses, batched training forwards, checkpoints, the model catalog and the
host that keeps one base model with many LoRA adapters in memory.
"""
