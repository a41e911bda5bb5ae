"""OpenAI-compatible HTTP API of the gateway (FastAPI on uvicorn, in the gateway's event loop).

Requests run through the same Pipeline as the gRPC API (validation, stops, replicas, metrics,
deadlines), so an HTTP request and a gRPC request with the same fields produce the same text.
"""
