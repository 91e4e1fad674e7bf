"""Quantized layer methods and the checkpoint quantization configs that choose them (issue #30)."""
