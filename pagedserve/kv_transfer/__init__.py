"""KV transfer between engines: the KV connector seam (connector_base.py) and its connectors.

A connector has a scheduler side (which requests load KV from elsewhere, which keep their blocks after they finish)
and a worker side (moving the bytes of KV pages). The scheduler and the worker only call the seam; everything a
connector needs lives in this package. Connectors: PullConnector (prefill/decode disaggregation: the decode engine
pulls the prefill engine's blocks over ZeroMQ) and MultiConnector (several connectors composed).
"""
