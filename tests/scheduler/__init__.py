"""Scheduling: continuous batching, admission, finishing, mixed chunks, step plans, the overlap schedule."""
