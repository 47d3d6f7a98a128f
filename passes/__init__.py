"""fxllm passes: one file per pass; importing this package registers them all."""

from fxllm.passes import cleanup, kv_cache  # noqa: F401
