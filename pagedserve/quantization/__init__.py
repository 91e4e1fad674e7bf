"""Offline checkpoint quantization (`pagedserve quantize`)."""
