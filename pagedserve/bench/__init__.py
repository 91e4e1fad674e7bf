"""Benchmarks behind `pagedserve bench` (serve: an HTTP load generator)."""
