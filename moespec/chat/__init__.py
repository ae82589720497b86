"""Chat: text in, text out, over the token-id Engine (chat template, history, streaming)."""
