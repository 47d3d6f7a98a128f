"""fxllm passes: one file per pass; importing this package registers them all."""

from fxllm.passes import cleanup, dtype, fuse_projections, gqa, kv_cache, paged, quantize, select_logits  # noqa: F401
