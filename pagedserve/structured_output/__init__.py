"""Structured outputs: generation constrained by a JSON schema, a regex, a choice list or an EBNF grammar.

The split follows vLLM v1. `StructuredOutputsParams` rides on SamplingParams; the front end checks it
(grammar_validation.py) so bad input is a clear error before the engine sees it. In the engine core the
StructuredOutputManager compiles each distinct grammar once, on a worker thread (the request waits in the
scheduler meanwhile, the others keep stepping), keeps one matcher per request, fills the token bitmask of
the rows a step samples for constrained requests, and advances the matchers with every accepted token. The
model runner applies the bitmask (logits_mask.py) to those rows only, before sampling.
xgrammar is the grammar engine (backend "xgrammar").
"""
