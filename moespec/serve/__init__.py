"""`moespec serve`: an OpenAI-compatible HTTP server over the offloading runtime.

One model, one generation at a time (batch 1): requests wait in a FIFO queue served by one
worker thread that owns the Engine, so the KV prefix of a conversation that extends the
previous request is reused exactly as in `moespec chat`. /metrics exposes, next to the usual
request and latency metrics, what the expert cache is doing, per layer.

Modules: errors (OpenAI error JSON), schemas (request bodies, OpenAI's ranges), body (raw bytes
-> schema), messages (chat messages -> template dicts), plan (a request -> its choices), tools
and tool_formats (tool calling per model family), generate (one choice on the worker), stops
(stop strings), queue (FIFO + worker), backend (model side: render, generate), responses (JSON
and SSE bodies), metrics (Prometheus), security (API key, body limit), app (the FastAPI routes).
Logits processing (penalties, logit_bias, grammar masks, logprobs) is moespec/sampling.
"""
