"""fxllm passes: one file per pass; importing this package registers them all."""

from fxllm.passes import cleanup, fuse_projections, kv_cache  # noqa: F401
