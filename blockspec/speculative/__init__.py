"""Speculative decoding: the DFlash worker (propose, verify, accept, commit), its verify-length policies, simulated
acceptance for benchmarks, and worker building for DFlash."""
