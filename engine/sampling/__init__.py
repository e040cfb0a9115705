"""The sampling layer: the continuous decode batch and the arithmetic of a decode step.

Token choice (counter-based RNG, temperature / top-k / top-p), the row-invariant kernels that make a
row's result independent of its batch, and the decode steps themselves.
"""
