"""The SmolLM2 + DFlash GSM8K demo (`make demo`)."""
