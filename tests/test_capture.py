"""Capture: one fxllm.attention node per layer with K/V at the KV heads, logits equal to eager transformers."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from fxllm.compiler.capture import capture, sample_inputs
from fxllm.compiler.interface import run_sequence
from fxllm.compiler.sources import load_model, resolve_source
from fxllm.errors import ModelSourceError


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "gpt2"])
def test_capture_has_one_attention_per_layer_fed_by_kv_heads(arch, make_tiny_model):
    """Faithful to transformers: K/V are computed at the KV heads and repeated to the query heads (repeat_kv)
    right in front of the one fxllm.attention node per layer; no mask construction reaches the graph."""
    from fxllm.compiler.lint import refresh_meta
    from fxllm.compiler.patterns import match_repeat_kv

    model = load_model(resolve_source(make_tiny_model(arch)))
    program = capture(model).program
    attention = [n for n in program.graph.nodes if n.target is torch.ops.fxllm.attention.default]
    assert len(attention) == program.spec.num_layers == 2
    refresh_meta(program)
    for node in attention:
        q, k, v = (arg.meta["val"] for arg in node.args[:3])
        assert q.shape[1] == k.shape[1] == v.shape[1] == program.spec.num_heads
        for kv in node.args[1:3]:
            repeat = match_repeat_kv(kv)
            if program.spec.num_kv_heads == program.spec.num_heads:
                assert repeat is None
            else:
                assert repeat[1] == program.spec.num_heads // program.spec.num_kv_heads
                assert repeat[0].meta["val"].shape[1] == program.spec.num_kv_heads
    targets = {str(n.target) for n in program.graph.nodes if n.op == "call_function"}
    assert not any("scaled_dot_product" in t or "tril" in t or "triu" in t for t in targets)


def test_captured_logits_match_eager(make_tiny_model):
    directory = make_tiny_model("llama")
    program = capture(load_model(resolve_source(directory))).program
    eager = AutoModelForCausalLM.from_pretrained(directory, attn_implementation="eager").eval()
    ids, _ = sample_inputs(batch=2, tokens=12, vocab=program.spec.vocab_size)
    with torch.no_grad():
        expected = eager(ids).logits
    torch.testing.assert_close(run_sequence(program, ids), expected, atol=1e-5, rtol=1e-5)


def test_spec_records_model_facts(make_tiny_model):
    spec = capture(load_model(resolve_source(make_tiny_model("llama")))).program.spec
    assert (spec.num_layers, spec.num_heads, spec.num_kv_heads, spec.head_dim) == (2, 4, 2, 16)
    assert spec.vocab_size == 49152 and spec.max_positions == 256
    assert spec.rope["rope_theta"] > 0
    assert spec.kv_bytes_per_token() == 2 * 2 * 2 * 16 * 4


def test_sliding_window_is_carried_by_each_attention_node(tmp_path, tokenizer):
    """The window rides on the op (the context stays the model's), and the spec records it per layer."""
    from transformers import MistralConfig, MistralForCausalLM

    from tests.conftest import TINY_COMMON

    torch.manual_seed(0)
    MistralForCausalLM(MistralConfig(**TINY_COMMON, sliding_window=64)).save_pretrained(tmp_path)
    program = capture(load_model(resolve_source(tmp_path))).program
    windows = [n.args[4] for n in program.graph.nodes if n.target is torch.ops.fxllm.attention.default]
    assert windows == [64, 64]
    assert program.spec.max_positions == TINY_COMMON["max_position_embeddings"]
    assert program.spec.sliding_windows == [64, 64] and program.spec.attention_span == 64
    assert [layer["attention"] for layer in program.spec.layers] == ["sliding 64", "sliding 64"]


def test_pass_option_types_come_from_defaults_and_annotations():
    from fxllm.compiler.pass_registry import _REGISTRY, register_pass

    @register_pass("test-option-types")
    def typed(program, *, flag: bool | None = None, count: int | None = None, ratio: float = 0.5, label="x"):
        """Test-only pass."""
        return program

    try:
        assert _REGISTRY["test-option-types"].option_types == {"flag": bool, "count": int, "ratio": float,
                                                                "label": str}
    finally:
        del _REGISTRY["test-option-types"]


def test_a_config_without_special_token_fields_gives_a_spec():
    """CodeGen's config has no pad_token_id attribute at all (not even None): the spec records None, not an
    internal error (AttributeError) at capture."""
    from transformers import CodeGenConfig

    from fxllm.compiler.capture import spec_from_config

    config = CodeGenConfig(vocab_size=64, n_embd=32, n_layer=1, n_head=4, n_positions=64, rotary_dim=4,
                           bos_token_id=1, eos_token_id=2)
    assert not hasattr(config, "pad_token_id")
    spec = spec_from_config(config, "CodeGenForCausalLM")
    assert (spec.pad_token_id, spec.bos_token_id, spec.eos_token_ids) == (None, 1, [2])


def test_special_token_ids_outside_the_vocabulary():
    """A pad id of -1 (old LLaMA conversions) means none; a bos or end id outside the vocabulary is refused at the
    capture (the compile wrote an artifact no command could load: 'names token id -1, outside the vocabulary')."""
    from transformers import GenerationConfig, LlamaConfig

    from fxllm.compiler.capture import spec_from_config
    from tests.conftest import TINY_COMMON

    spec = spec_from_config(LlamaConfig(**{**TINY_COMMON, "pad_token_id": -1}), "LlamaForCausalLM")
    assert (spec.pad_token_id, spec.bos_token_id, spec.eos_token_ids) == (None, 1, [2])
    for field, value, says in (("eos_token_id", 1_000_000, "the config's eos_token_id 1000000"),
                               ("eos_token_id", [2, -1], "the config's eos_token_id -1"),
                               ("bos_token_id", 49152, "the config's bos_token_id 49152")):
        with pytest.raises(ModelSourceError, match=f"{says} is not a token id of the model's vocabulary "
                                                   r"\(0 to 49151\)"):
            spec_from_config(LlamaConfig(**{**TINY_COMMON, field: value}), "LlamaForCausalLM")
    with pytest.raises(ModelSourceError, match="generation_config.json's eos_token_id 70000"):
        spec_from_config(LlamaConfig(**TINY_COMMON), "LlamaForCausalLM", generation_config=GenerationConfig(
            eos_token_id=[2, 70000]))


def test_generation_config_end_ids_end_a_generation(make_tiny_model, tmp_path):
    """An end id only in generation_config.json (an instruct model's end of turn) ends fxllm's generation where it
    ends transformers' (fxllm read only the config's and generated past it)."""
    import shutil

    import fxllm
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    source = tmp_path / "model"
    shutil.copytree(make_tiny_model("llama"), source)
    tokenizer = AutoTokenizer.from_pretrained(source)
    prompt = tokenizer("Hello there", return_tensors="pt").input_ids
    model = AutoModelForCausalLM.from_pretrained(source)
    free = model.generate(prompt, max_new_tokens=6, do_sample=False)[0, prompt.shape[1]:].tolist()
    end = next(token for token in free[1:] if token != 2)
    GenerationConfig(bos_token_id=1, eos_token_id=[2, end], pad_token_id=2).save_pretrained(source)
    model = AutoModelForCausalLM.from_pretrained(source)
    expected = model.generate(prompt, max_new_tokens=6, do_sample=False)[0, prompt.shape[1]:].tolist()
    assert expected[-1] == end and len(expected) < len(free)
    fxllm.compile(source, tmp_path / "artifact")
    result = fxllm.load(tmp_path / "artifact").generate_ids([prompt[0].tolist()], max_new_tokens=6)[0]
    assert (result.token_ids, result.finish_reason) == (expected, "eos")
