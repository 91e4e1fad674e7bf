"""Speculative decoding: proposers, the rejection sampler, and the runner's speculation seam."""
