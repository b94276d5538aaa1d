"""Tensor parallelism below the model: the rank group and its collectives, sharded weight loading."""
