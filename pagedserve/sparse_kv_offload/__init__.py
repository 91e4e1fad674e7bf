"""Sparse KV offload for DeepSeek sparse-attention models (config/sparse_kv_offload.py): the latent rows in a
second tier, the indexer keys resident, per request and layer an LRU buffer of the selected blocks."""
