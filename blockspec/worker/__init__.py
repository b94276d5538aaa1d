"""Workers: what one step runs on the device (the Worker protocol, the target-only worker, what is in flight)."""
