"""Fused Triton ops and programmatic dependent launch."""
