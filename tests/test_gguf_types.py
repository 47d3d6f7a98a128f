"""GGUF sources beyond the shipped Q4_1: SmolLM2's own weights re-written as Q8_0 and Q4_0 load through the same path
(transformers dequantizes to float32) and give nearly the same model as the Q4_1 file they came from. The files are
SmolLM2 cut to 2 layers and 2,048 tokens (tests/gguf_files.smollm2_cut): real weights, real tokenizer, and a
vocabulary transformers parses quickly."""

from __future__ import annotations

import pytest
import torch

from fxllm.compiler.source_checks import source_architecture
from fxllm.compiler.sources import load_model, load_tokenizer, resolve_source
from tests.gguf_files import smollm2_cut

TEXT = "The capital of France is Paris, and the capital of Germany is"


@pytest.fixture(scope="module")
def shipped_cut(tmp_path_factory):
    """The shipped Q4_1 blocks as stored, cut the same way: the model the re-written files are compared with."""
    return smollm2_cut(tmp_path_factory.mktemp("q4_1") / "smollm2-cut.Q4_1.gguf")


# Measured on the cut: KL 0.00016 (Q8_0) and 0.12 (Q4_0, a symmetric 4-bit re-rounding of already 4-bit weights)
# against the shipped Q4_1 blocks; on the whole model 0.0033 and 0.72. An unrelated model is several nats away.
@pytest.mark.parametrize("kind_name,max_kl", [("Q8_0", 0.01), ("Q4_0", 1.0)])
def test_other_gguf_types_load_as_float(kind_name, max_kl, shipped_cut, tmp_path):
    from gguf import GGUFReader

    path = smollm2_cut(tmp_path / f"smollm2-cut.{kind_name}.gguf", kind=kind_name)
    assert {t.tensor_type.name for t in GGUFReader(path).tensors} == {kind_name, "F32"}
    assert source_architecture(resolve_source(str(path))) == "gguf:llama"
    model, reference = load_model(resolve_source(str(path))), load_model(resolve_source(str(shipped_cut)))
    ids = torch.tensor([load_tokenizer(resolve_source(str(path)))(TEXT)["input_ids"]])
    with torch.no_grad():
        ours, expected = model(ids).logits.log_softmax(-1), reference(ids).logits.log_softmax(-1)
    kl = (expected.exp() * (expected - ours)).sum(-1).mean()
    assert 0 <= kl < max_kl  # a re-quantization of the same weights: near the shipped Q4_1 blocks
