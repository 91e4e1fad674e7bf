"""Reasoning parsers: split a reasoning model's output into `reasoning_content` and `content` (the server's
`--reasoning-parser`), and tell structured outputs where the reasoning ends (their grammar applies after it)."""
