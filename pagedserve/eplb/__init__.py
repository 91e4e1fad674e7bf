"""Expert-parallel load balancing: load recording, placement policies ('default', 'flashlb'), weight moves
and the worker's periodic step hook. MoE layers never import this package; it drives them."""
