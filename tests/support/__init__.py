"""Helpers the tests share: tiny checkpoints, engine runs and checks, server processes, fakes."""
