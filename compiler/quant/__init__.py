"""Weight quantization algorithms (RTN, GPTQ, AWQ), their numerics, calibration data and scale folding; the
`quantize` pass (passes/quantize.py) drives them. kv_cache.py: an int8 KV cache's scales and drift (compile_model's
kv_cache_dtype)."""
