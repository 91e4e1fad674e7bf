"""Model families (one file each) and the registry that maps HF architectures to them."""
from pagedserve.models.registry import register_model, resolve_model_class, supported_architectures

__all__ = ["register_model", "resolve_model_class", "supported_architectures"]
