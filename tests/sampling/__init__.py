"""Sampling, penalties, logprobs, grammars and tool calls."""
