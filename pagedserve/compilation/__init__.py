"""Graph compilation helpers: FX fusion passes and the fused operators they target."""
