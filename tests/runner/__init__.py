"""Running forwards: piecewise graphs, host index arrays, tensor parallelism, warm start."""
