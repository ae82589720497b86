"""`moespec serve`: an OpenAI-compatible HTTP server over the offloading runtime.

One model, one generation at a time (batch 1): requests wait in a FIFO queue served by one
worker thread that owns the Engine, so the KV prefix of a conversation that extends the
previous request is reused exactly as in `moespec chat`. /metrics exposes, next to the usual
request and latency metrics, what the expert cache is doing, per layer.

Modules: errors (OpenAI error JSON), schemas (request bodies), stops (stop strings),
queue (FIFO + worker), backend (model side: render, generate), metrics (Prometheus),
security (API key, body limit), app (the FastAPI routes).
"""
