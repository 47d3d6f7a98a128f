"""Tests of `fxllm serve`: a real uvicorn server in a subprocess, driven by the official openai client."""
