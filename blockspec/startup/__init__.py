"""Engine start-up: kernel warm-up, the compile counter, the start-up report."""
