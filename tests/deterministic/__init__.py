"""--enable-deterministic-inference: the batch-invariant kernels and the engine end to end."""
