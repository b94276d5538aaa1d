"""Accuracy evaluations against a running blockspec (or SGLang / OpenAI-compatible) server."""
