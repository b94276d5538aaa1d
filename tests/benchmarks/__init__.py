"""The benchmarks/ package, each benchmark on the CPU."""
