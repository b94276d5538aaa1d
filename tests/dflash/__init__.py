"""DFlash speculative decoding: losslessness, the z-lab oracle, sampling, adaptive verify, the shipped draft."""
