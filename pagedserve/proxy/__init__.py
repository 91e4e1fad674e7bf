"""`pagedserve proxy`: an OpenAI-compatible front that sends each request to a prefill then a decode instance."""
