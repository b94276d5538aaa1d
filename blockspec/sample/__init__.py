"""Sampling: per-request sampling and penalties, grammar masks, and the rejection sampling of speculative verify."""
