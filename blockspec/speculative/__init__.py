"""Speculative decoding: the DFlash worker (propose, verify, accept, commit), its verify-length policies, and
simulated acceptance for benchmarks."""
