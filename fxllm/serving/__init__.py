"""The OpenAI-compatible HTTP server (`fxllm serve`)."""
