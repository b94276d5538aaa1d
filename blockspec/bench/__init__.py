"""Benchmarks against a running blockspec (or SGLang) server."""
