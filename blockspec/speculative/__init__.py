"""Speculative decoding: the DFlash worker (propose, verify, accept, commit; DFlash and DFlash2 drafts), the host
walk of sampled and constrained requests' proposals, its verify-length policies, and simulated acceptance for
benchmarks."""
