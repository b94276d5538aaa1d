"""Attention backends: Triton, graphed extend attention, FlashInfer."""
