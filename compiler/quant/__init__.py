"""Weight quantization algorithms (RTN, GPTQ, AWQ), their numerics, calibration data and scale folding; the
`quantize` pass (passes/quantize.py) drives them."""
