"""The test suite: one folder per subsystem, shared helpers in tests/support/, shared fixtures in tests/conftest.py."""
