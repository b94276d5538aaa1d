"""blockspec.bench: the serving benchmark's client, processes, core clock and CLI."""
