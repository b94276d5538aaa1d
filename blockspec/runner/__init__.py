"""How a forward runs: the model runner (full CUDA graph, piecewise graph or eager, decided in one place), the graph
captures, the tensor-parallel forward mirror, and the kernel settings of deterministic inference."""
