"""GPU-only tests (skipped without CUDA)."""
