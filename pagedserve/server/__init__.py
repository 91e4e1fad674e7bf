"""The OpenAI-compatible HTTP server: `pagedserve serve` (see docs/serving.md)."""
