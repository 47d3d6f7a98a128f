"""Targets: lowering the rewritten graph to ONNX (translations of fxllm's ops, export, packing), and what is
specific to TensorRT (its parser's support table, the audit against it, the engine build)."""
