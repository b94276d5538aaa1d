"""Tensor parallelism: the rank group, sharded weight loading, the forward mirror and the rank processes."""
