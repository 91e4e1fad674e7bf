"""Model loading: build a model class and fill it from a weight stream (safetensors by default)."""
from pagedserve.model_loader.model_factory import load_model
from pagedserve.model_loader.safetensors_loader import iterate_safetensors_weights, safetensors_weight_files

get_model = load_model

__all__ = ["get_model", "iterate_safetensors_weights", "load_model", "safetensors_weight_files"]
