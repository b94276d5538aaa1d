"""The engine step: what a step launches (StepPlan), the workers that run it, what is in flight, and the overlap
schedule that commits a step while the device runs the next (StepExecutor)."""
