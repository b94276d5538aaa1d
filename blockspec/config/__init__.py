"""Engine configuration: EngineConfig (every flag once) and the cross-flag checks, which return resolved values.
Imports nothing of blockspec: every other layer may read it."""
