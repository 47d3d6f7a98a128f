"""Model coverage: tiny random-weight models (2 layers, SmolLM2's tokenizer) of the decoder-only families people
deploy compile with the default pipeline and give transformers' greedy tokens, single and batched; their TensorRT
form passes the audit. Attention variants (sliding windows shorter than the prompts, soft-capping, sinks), partial
or absent rotary embeddings, QK-norm, scaled or soft-capped logits and mixture-of-experts layers are all in the
matrix. Models with a feature fxllm cannot express are refused in one line naming it, with nothing written."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import fxllm
from fxllm.cli import main
from fxllm.compiler.sources import load_model, load_tokenizer, resolve_source
from fxllm.errors import UnsupportedModelError
from tests.conftest import PROMPTS
from tests.gguf_files import TINY_ARCHITECTURES, tiny_hf_model, write_gguf

WINDOW = 8  # shorter than every prompt plus its 32 new tokens: the windows are exercised
NEW_TOKENS = 32
COMMON = dict(vocab_size=49152, hidden_size=64, num_attention_heads=4, num_hidden_layers=2,
              max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=2)
GQA = dict(num_key_value_heads=2)
MOE = dict(num_experts_per_tok=2)


@dataclass(frozen=True)
class Arch:
    """One row of the matrix: the transformers config class, its fields beyond COMMON, the features the compiled
    artifact's spec must show (FEATURES; checked by the test) and what else the model exercises."""

    config_class: str
    fields: dict
    features: tuple[str, ...] = ()
    also: str = ""
    perturbed: bool = False  # norms, biases and zero-initialized weights randomized (see build_model)


SLIDING, SOFTCAP, SINKS, MOE_LAYERS = "sliding window", "attention soft-capping", "attention sinks", "MoE"
PARTIAL_ROPE, NO_ROPE, QK_NORM, LEARNED = "partial RoPE", "layers without RoPE", "QK-norm", "learned positions"
FEATURES = (SLIDING, SOFTCAP, SINKS, MOE_LAYERS, PARTIAL_ROPE, NO_ROPE, QK_NORM, LEARNED)

ARCHITECTURES = {
    "qwen3": Arch("Qwen3Config", dict(**GQA, intermediate_size=96, head_dim=16, use_sliding_window=True,
                                      sliding_window=WINDOW, max_window_layers=1), (SLIDING, QK_NORM),
                  "a full then a sliding layer"),
    "qwen3_moe": Arch("Qwen3MoeConfig", dict(**GQA, **MOE, intermediate_size=96, head_dim=16, num_experts=4,
                                             moe_intermediate_size=32, norm_topk_prob=True), (MOE_LAYERS, QK_NORM)),
    "mixtral": Arch("MixtralConfig", dict(**GQA, **MOE, intermediate_size=32, num_local_experts=4,
                                          sliding_window=WINDOW), (SLIDING, MOE_LAYERS)),
    "gemma": Arch("GemmaConfig", dict(**GQA, intermediate_size=96, head_dim=16), (),
                  "scaled embeddings, (1 + w) norms"),
    "gemma2": Arch("Gemma2Config", dict(**GQA, intermediate_size=96, head_dim=16, sliding_window=WINDOW,
                                        query_pre_attn_scalar=24, attn_logit_softcapping=2.0,
                                        final_logit_softcapping=3.0), (SLIDING, SOFTCAP),
                   "alternating windows, final-logit soft-capping"),
    "gemma3": Arch("Gemma3TextConfig", dict(**GQA, intermediate_size=96, head_dim=16, sliding_window=WINDOW,
                                            sliding_window_pattern=2, query_pre_attn_scalar=24,
                                            final_logit_softcapping=3.0), (SLIDING, QK_NORM),
                   "alternating windows, final-logit soft-capping"),
    "phi3": Arch("Phi3Config", dict(**GQA, intermediate_size=96, sliding_window=WINDOW, partial_rotary_factor=0.5),
                 (SLIDING, PARTIAL_ROPE), "fused qkv and gate/up"),
    "phi": Arch("PhiConfig", dict(intermediate_size=96, partial_rotary_factor=0.5, qk_layernorm=True),
                (PARTIAL_ROPE, QK_NORM), "multi-head attention, parallel blocks"),
    "gpt_neox": Arch("GPTNeoXConfig", dict(intermediate_size=96, rotary_pct=0.25), (PARTIAL_ROPE,),
                     "no KV-head field in the config"),
    "starcoder2": Arch("Starcoder2Config", dict(**GQA, intermediate_size=96, sliding_window=WINDOW), (SLIDING,)),
    "granite": Arch("GraniteConfig", dict(**GQA, intermediate_size=96, embedding_multiplier=12.0, logits_scaling=8.0,
                                          residual_multiplier=0.22, attention_multiplier=0.05), (),
                    "scaled embeddings, residuals, attention and logits"),
    "smollm3": Arch("SmolLM3Config", dict(**GQA, intermediate_size=96, no_rope_layer_interval=2,
                                          use_sliding_window=True, sliding_window=WINDOW), (SLIDING, NO_ROPE)),
    "gpt_oss": Arch("GptOssConfig", dict(**GQA, **MOE, intermediate_size=32, head_dim=16, sliding_window=WINDOW,
                                         num_local_experts=4), (SLIDING, SINKS, MOE_LAYERS),
                    "experts with biases and a clamped SwiGLU"),
    "falcon": Arch("FalconConfig", dict(), (), "multi-query; its attention calls scaled_dot_product_attention"),
    "opt": Arch("OPTConfig", dict(ffn_dim=96, word_embed_proj_dim=64), (LEARNED,), "pre-scaled queries"),
    "ministral": Arch("MinistralConfig", dict(**GQA, intermediate_size=96, head_dim=16, sliding_window=WINDOW,
                                              layer_types=["sliding_attention", "full_attention"]), (SLIDING,)),
    "mistral": Arch("MistralConfig", dict(**GQA, intermediate_size=96, sliding_window=WINDOW), (SLIDING,)),
    "gptj": Arch("GPTJConfig", dict(rotary_dim=8, n_inner=96), (PARTIAL_ROPE,),
                 "interleaved rotary on part of each head, parallel blocks", perturbed=True),
    "cohere2": Arch("Cohere2Config", dict(**GQA, intermediate_size=96, sliding_window=WINDOW,
                                          layer_types=["sliding_attention", "full_attention"]), (SLIDING, NO_ROPE),
                    "interleaved rotary (sliding layers only), parallel blocks, LayerNorm, scaled logits",
                    perturbed=True),
    "exaone4": Arch("Exaone4Config", dict(**GQA, intermediate_size=96, head_dim=16, sliding_window=WINDOW,
                                          sliding_window_pattern=2,
                                          layer_types=["sliding_attention", "full_attention"]),
                    (SLIDING, NO_ROPE, QK_NORM), "RoPE in sliding layers only, norms after attention and MLP",
                    perturbed=True),
    "olmo2": Arch("Olmo2Config", dict(**GQA, intermediate_size=96), (QK_NORM,),
                  "norms after attention and MLP, QK-norm over all heads", perturbed=True),
    "nemotron": Arch("NemotronConfig", dict(**GQA, intermediate_size=96, head_dim=16), (PARTIAL_ROPE,),
                     "squared-ReLU MLP, (1 + w) LayerNorm", perturbed=True),
    "stablelm": Arch("StableLmConfig", dict(**GQA, intermediate_size=96, qk_layernorm=True,
                                            use_parallel_residual=True, use_qkv_bias=True), (PARTIAL_ROPE, QK_NORM),
                     "per-head LayerNorm QK-norm, parallel residual, qkv bias", perturbed=True),
    "glm4": Arch("Glm4Config", dict(**GQA, intermediate_size=96, head_dim=16), (PARTIAL_ROPE,),
                 "interleaved partial rotary, norms after attention and MLP", perturbed=True),
    "gpt_bigcode": Arch("GPTBigCodeConfig", dict(n_inner=96), (), "multi-query, learned absolute positions",
                        perturbed=True),
}


def features_of(layers: list[dict]) -> set[str]:
    """The FEATURES an artifact's per-layer description (spec.layers) shows."""
    found = set()
    for layer in layers:
        rope = layer["rope"]
        shown = {SLIDING: layer["attention"].startswith("sliding"), SOFTCAP: bool(layer.get("softcap")),
                 SINKS: bool(layer.get("sinks")), MOE_LAYERS: bool(layer.get("moe")),
                 QK_NORM: bool(layer.get("qk_norm")), PARTIAL_ROPE: rope.startswith("partial"),
                 NO_ROPE: rope == "none", LEARNED: rope == "learned positions"}
        found |= {feature for feature, present in shown.items() if present}
    return found


def build_model(arch: str, directory: Path, tokenizer) -> Path:
    import transformers

    entry = ARCHITECTURES[arch]
    config = getattr(transformers, entry.config_class)(**{**COMMON, **entry.fields})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config).eval()
        if entry.perturbed:
            perturb(model)
        model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def perturb(model: torch.nn.Module) -> None:
    """Noise on the norms and biases and random values where a weight starts all zero: with their initial ones and
    zeros (and transformers' small default init) some families' tiny models repeat one token, which would compare
    nothing; this way a wrong norm offset, bias or parallel branch changes the tokens."""
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.ndim == 1:
                parameter.add_(torch.randn_like(parameter) * 0.1)
            elif not parameter.any():
                parameter.normal_(0.0, 0.1)
            else:
                parameter.mul_(5.0)  # transformers' std 0.02 → 0.1


def transformers_tokens(directory: Path, tokenizer, prompts: list[str]) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    return reference_tokens(AutoModelForCausalLM.from_pretrained(directory).eval(), tokenizer, prompts)


def reference_tokens(model, tokenizer, prompts: list[str]) -> list[list[int]]:
    """transformers' greedy tokens for each prompt alone, EOS ignored."""
    out = []
    for prompt in prompts:
        ids = torch.tensor([tokenizer(prompt)["input_ids"]])
        with torch.no_grad():
            generated = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                       max_new_tokens=NEW_TOKENS, eos_token_id=None,
                                       pad_token_id=tokenizer.pad_token_id)
        out.append(generated[0, ids.shape[1]:].tolist())
    return out


def engine_tokens(artifact: Path, prompts: list[str], **load) -> tuple[list[list[int]], list[list[int]]]:
    """(one prompt at a time, all prompts in one call) greedy tokens, EOS ignored."""
    engine = fxllm.load(artifact, **load)
    engine.eos_token_ids = set()
    single = [engine.generate(prompt, max_new_tokens=NEW_TOKENS).token_ids for prompt in prompts]
    batched = [result.token_ids for result in engine.generate(prompts, max_new_tokens=NEW_TOKENS)]
    return single, batched


def audit_findings(artifact: Path, capsys) -> int:
    import json

    capsys.readouterr()
    main(["inspect", str(artifact), "--check", "tensorrt", "--json"])
    return len(json.loads(capsys.readouterr().out)["findings"])


@pytest.mark.parametrize("arch", [pytest.param(a, marks=pytest.mark.xdist_group(f"arch-{a}")) for a in ARCHITECTURES])
def test_compiles_and_matches_transformers(arch, tokenizer, tmp_path, capsys):
    directory = build_model(arch, tmp_path / arch, tokenizer)
    expected = transformers_tokens(directory, tokenizer, PROMPTS)
    fxllm.compile(directory, tmp_path / "ort")
    single, batched = engine_tokens(tmp_path / "ort", PROMPTS)
    assert single == expected and batched == expected
    assert features_of(fxllm.load(tmp_path / "ort").spec.layers) == set(ARCHITECTURES[arch].features)
    fxllm.compile(directory, tmp_path / "trt", target="tensorrt")
    assert audit_findings(tmp_path / "trt", capsys) == 0
    assert engine_tokens(tmp_path / "trt", PROMPTS[:2])[0] == expected[:2]


# Every architecture transformers' GGUF loader reads that tests/gguf_files can write; Mistral is left out because
# transformers cannot read a Mistral GGUF back (it looks 'mistral' up among gguf-py's architectures, which have none).
GGUF_ARCHITECTURES = [a for a in TINY_ARCHITECTURES if a != "mistral"]


@pytest.mark.parametrize("arch", [pytest.param(a, marks=pytest.mark.xdist_group(f"gguf-{a}"))
                                  for a in GGUF_ARCHITECTURES])
def test_gguf_architectures_keep_their_blocks_and_match_transformers(arch, tmp_path, capsys):
    """A Q8_0 GGUF of each architecture (written with the `gguf` package from a tiny random model with a 2,048-token
    cut of SmolLM2's tokenizer) compiles keeping its blocks, gives the greedy tokens of transformers' model loaded
    from the same file, single and batched, and its TensorRT form passes the audit."""
    path = write_gguf(tiny_hf_model(arch, tmp_path / "hf"), tmp_path / "gguf" / f"{arch}.Q8_0.gguf", "Q8_0")
    source = resolve_source(str(path))
    expected = reference_tokens(load_model(source), load_tokenizer(source), PROMPTS)
    report = fxllm.compile(str(path), tmp_path / "ort")
    quantize = next(r for r in report.records if r.name == "quantize")
    assert quantize.diagnostics["fallbacks"] == {} and all(layer["note"] == "gguf Q8_0 kept"
                                                           for layer in quantize.diagnostics["layers"])
    single, batched = engine_tokens(tmp_path / "ort", PROMPTS)
    assert single == expected and batched == expected
    fxllm.compile(str(path), tmp_path / "trt", target="tensorrt")
    assert audit_findings(tmp_path / "trt", capsys) == 0


PAGED = "cleanup,gqa,fuse-projections,select-logits,kv-cache,paged:block_size=4"
MIXED = PROMPTS + ["Hello", "One two three four five six seven eight nine ten eleven twelve thirteen"]


@pytest.mark.parametrize("arch", [pytest.param(a, marks=pytest.mark.xdist_group(f"arch-{a}-variants"))
                                  for a in ("mistral", "gemma2", "gpt_oss")])
def test_variants_through_paged_and_int8(arch, tokenizer, tmp_path):
    """One sliding-window (every layer slides: blocks behind the window are released), one soft-capped, one MoE
    model (with sinks): paged with mixed lengths, also under a pool that forces preemption, equals the contiguous
    artifact; int8 compiles and reports its drift."""
    directory = build_model(arch, tmp_path / arch, tokenizer)
    fxllm.compile(directory, tmp_path / "contiguous")
    expected, _ = engine_tokens(tmp_path / "contiguous", MIXED)
    fxllm.compile(directory, tmp_path / "paged", passes=PAGED)
    for blocks in (None, 20):
        single, batched = engine_tokens(tmp_path / "paged", MIXED, **({"kv_blocks": blocks} if blocks else {}))
        assert single == expected and batched == expected, blocks
    report = fxllm.compile(directory, tmp_path / "int8", quant="int8")
    drift = next(r for r in report.records if r.name == "quantize").drift
    assert 0 < drift.mean_kl < 0.05 and drift.greedy_agreement >= 0.5
    print(f"{arch} int8 drift: max|Δlogit| {drift.max_abs_logit:.3g}, KL {drift.mean_kl:.2g}, "
          f"greedy {drift.greedy_agreement:.0%}")


@pytest.mark.parametrize("arch", [pytest.param(a, marks=pytest.mark.xdist_group(f"arch-{a}-paged"))
                                  for a in ("qwen3", "falcon")])
def test_paged_where_the_rotary_stays_on_the_heads(arch, tokenizer, tmp_path):
    """A QK-norm (qwen3) and a multi-query (falcon) model rotate k in its [B, H, T, D] form, which the ort
    paged-attention step cannot move to the 3D form: their paged compile (a cycle through new_key_i in the
    legalized graph before) equals the contiguous artifact, one prompt at a time and batched, with a context long
    enough for the pool form."""
    directory = build_model(arch, tmp_path / arch, tokenizer)
    prompts = MIXED + [" ".join(f"word{i}" for i in range(80))]
    fxllm.compile(directory, tmp_path / "contiguous")
    expected, _ = engine_tokens(tmp_path / "contiguous", prompts)
    fxllm.compile(directory, tmp_path / "paged", passes=PAGED)
    single, batched = engine_tokens(tmp_path / "paged", prompts)
    assert single == expected and batched == expected


def test_a_head_size_the_attention_kernel_refuses(tokenizer, tmp_path):
    """ONNX Runtime's GroupQueryAttention refuses, when it runs, a head size that is not a multiple of 8: a model
    with heads of 12 compiled and then failed on every call. Its attention keeps the standard form (contiguous and
    paged) and matches transformers."""
    import transformers

    config = transformers.LlamaConfig(**{**COMMON, "hidden_size": 48}, **GQA, intermediate_size=72)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        transformers.AutoModelForCausalLM.from_config(config).eval().save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    expected = transformers_tokens(tmp_path / "model", tokenizer, PROMPTS[:3])
    for name, passes in (("contiguous", None), ("paged", PAGED)):
        fxllm.compile(tmp_path / "model", tmp_path / name, passes=passes)
        single, batched = engine_tokens(tmp_path / name, PROMPTS[:3])
        assert single == expected and batched == expected, name


def test_a_product_with_a_transposed_weight_is_quantized(tokenizer, tmp_path):
    """Falcon's projections compute `x @ W.T` (no linear): cleanup spells them as linears, exactly, so int8 finds
    every projection (it refused: 'the calibration walk ended before reaching every linear layer')."""
    import onnx

    directory = build_model("falcon", tmp_path / "falcon", tokenizer)
    report = fxllm.compile(directory, tmp_path / "int8", quant="int8")
    assert next(r for r in report.records if r.name == "cleanup").drift.max_abs_logit == 0
    assert 0 < next(r for r in report.records if r.name == "quantize").drift.mean_kl < 0.05
    model = onnx.load(str(tmp_path / "int8" / "model.onnx"), load_external_data=False)
    int8 = [t for t in model.graph.initializer if t.data_type == onnx.TensorProto.INT8 and len(t.dims) == 2]
    assert len(int8) >= 3 * COMMON["num_hidden_layers"]  # per layer: the fused q/k/v (+ MLP up, both read one norm), dense, MLP down
    # without cleanup's rewrite there is nothing to quantize, and the compile says so (no artifact is written)
    from fxllm.errors import PipelineError

    with pytest.raises(PipelineError, match="no linear projection with a constant weight to quantize"):
        fxllm.compile(directory, tmp_path / "nothing", quant="int8",
                      passes="gqa,fuse-projections,select-logits,quantize,kv-cache")
    assert not (tmp_path / "nothing").exists()


def test_learned_positions_quantize_and_draft_unrolled(tokenizer, tmp_path):
    """OPT (learned positions, a context of 256 under the quantizer's 512-token windows): a self-int4 draft
    compiles (the calibration windows are cut to the context) and its unrolled graph proposes what its one-step
    calls do: the target's greedy tokens either way."""
    directory = build_model("opt", tmp_path / "opt", tokenizer)
    fxllm.compile(directory, tmp_path / "spec", draft="self-int4", spec_k=3)
    plain = fxllm.load(tmp_path / "spec", speculative=False)
    expected = [r.token_ids for r in plain.generate(PROMPTS, max_new_tokens=16)]
    for unrolled in (False, True):
        engine = fxllm.load(tmp_path / "spec", unrolled_draft=unrolled)
        assert [r.token_ids for r in engine.generate(PROMPTS, max_new_tokens=16)] == expected, unrolled
        assert engine.stats().speculative.accepted > 0


@pytest.mark.parametrize("arch", [pytest.param(a, marks=pytest.mark.xdist_group(f"arch-{a}-draft"))
                                  for a in ("gpt_neox", "falcon")])
def test_self_layers_draft_where_the_layers_are_not_model_layers(arch, tokenizer, tmp_path):
    """The decoder's layers live in gpt_neox.layers / transformer.h, not model.layers: a self-layers draft is cut
    from them (it refused), and speculative decoding keeps the target's greedy tokens."""
    directory = build_model(arch, tmp_path / arch, tokenizer)
    fxllm.compile(directory, tmp_path / "spec", draft="self-layers:1", spec_k=3)
    expected = [r.token_ids for r in fxllm.load(tmp_path / "spec", speculative=False).generate(PROMPTS,
                                                                                               max_new_tokens=16)]
    engine = fxllm.load(tmp_path / "spec")
    assert [r.token_ids for r in engine.generate(PROMPTS, max_new_tokens=16)] == expected
    assert engine.stats().speculative.proposed > 0


def test_sliding_window_blocks_are_released(tokenizer, tmp_path):
    """Every Mistral layer slides: a paged sequence holds only the blocks its window reaches, not its context."""
    directory = build_model("mistral", tmp_path / "mistral", tokenizer)
    fxllm.compile(directory, tmp_path / "paged", passes=PAGED)
    engine = fxllm.load(tmp_path / "paged", kv_blocks=64)
    engine.eos_token_ids = set()
    engine.generate(["Paris is"] * 4, max_new_tokens=100)
    stats = engine.stats()
    assert stats.kv_blocks_used == 0
    assert stats.peak_kv_blocks_used <= 4 * (WINDOW // 4 + 2) < 4 * (102 // 4)  # blocks of 4 tokens


def test_mistral_window_over_three_windows_of_prompt(tokenizer, tmp_path):
    """A prompt of more than 3 windows (and 32 tokens on top) equals transformers, contiguous (in one call and in
    calls shorter than the window) and paged."""
    directory = build_model("mistral", tmp_path / "mistral", tokenizer)
    prompt = " ".join(["one two three four five six seven eight"] * 4)
    assert len(tokenizer(prompt)["input_ids"]) >= 3 * WINDOW
    expected = transformers_tokens(directory, tokenizer, [prompt])
    fxllm.compile(directory, tmp_path / "contiguous")
    fxllm.compile(directory, tmp_path / "paged", passes=PAGED)
    for artifact in ("contiguous", "paged"):
        assert engine_tokens(tmp_path / artifact, [prompt])[0] == expected, artifact
    # the prompt prefilled in calls of 5 tokens: each call's window reaches back into the calls before it
    assert engine_tokens(tmp_path / "contiguous", [prompt], max_tokens_per_step=5)[0] == expected
    assert fxllm.load(tmp_path / "contiguous").spec.max_positions == COMMON["max_position_embeddings"]


def _bloom(directory: Path) -> None:
    from transformers import BloomConfig, BloomForCausalLM

    BloomForCausalLM(BloomConfig(vocab_size=100, hidden_size=32, n_head=2, n_layer=1)).save_pretrained(directory)


def _falcon_alibi(directory: Path) -> None:
    from transformers import FalconConfig, FalconForCausalLM

    FalconForCausalLM(FalconConfig(vocab_size=100, hidden_size=32, num_attention_heads=2, num_hidden_layers=1,
                                   alibi=True)).save_pretrained(directory)


def _mamba(directory: Path) -> None:
    from transformers import MambaConfig, MambaForCausalLM

    MambaForCausalLM(MambaConfig(vocab_size=100, hidden_size=32, num_hidden_layers=1, state_size=4)
                     ).save_pretrained(directory)


def _t5(directory: Path) -> None:
    from transformers import T5Config, T5ForConditionalGeneration

    T5ForConditionalGeneration(T5Config(vocab_size=100, d_model=32, d_ff=64, num_layers=1, num_heads=2, d_kv=16)
                               ).save_pretrained(directory)


@pytest.mark.parametrize("make, feature", [(_bloom, "ALiBi attention"), (_falcon_alibi, "ALiBi attention"),
                                           (_mamba, "recurrent/state-space layers"), (_t5, "encoder-decoder")])
def test_unsupported_features_are_refused_by_name(make, feature, tmp_path, capsys):
    make(tmp_path / "model")
    with pytest.raises(UnsupportedModelError, match=feature):
        fxllm.compile(tmp_path / "model", tmp_path / "out")
    capsys.readouterr()  # save_pretrained's progress bars
    assert main(["compile", str(tmp_path / "model"), "-o", str(tmp_path / "out")]) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and feature in lines[0], lines
    assert not (tmp_path / "out").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_readme_architecture_table_is_the_matrix():
    """README.md's table is generated from this matrix (scripts/architecture_table.py --update); a row added or
    removed here without regenerating it fails."""
    import subprocess
    import sys

    script = Path(__file__).resolve().parents[1] / "scripts" / "architecture_table.py"
    result = subprocess.run([sys.executable, str(script), "--check"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


DYNAMIC = dict(rope_type="dynamic", factor=2.0)
ROPE_PER_CALL = {
    "dynamic NTK": ("LlamaConfig", dict(**GQA, intermediate_size=96, rope_scaling=DYNAMIC)),
    "dynamic NTK on full layers only": ("Gemma3TextConfig", dict(**GQA, intermediate_size=96, head_dim=16,
                                                                 sliding_window=WINDOW, sliding_window_pattern=2,
                                                                 rope_scaling=DYNAMIC)),
    "LongRoPE within its original context": ("Phi3Config", dict(
        **GQA, intermediate_size=96, original_max_position_embeddings=COMMON["max_position_embeddings"],
        rope_scaling=dict(rope_type="longrope", long_factor=[1 + 0.1 * i for i in range(8)],
                          short_factor=[1 + 0.05 * i for i in range(8)]))),
}


def _tiny_model(config_class: str, fields: dict, directory: Path, tokenizer) -> Path:
    import transformers

    config = getattr(transformers, config_class)(**{**COMMON, **fields})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        transformers.AutoModelForCausalLM.from_config(config).eval().save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


@pytest.mark.parametrize("variant", list(ROPE_PER_CALL))
def test_rope_recomputed_per_call_is_exact_within_the_context(variant, tokenizer, tmp_path):
    """transformers recomputes dynamic-NTK frequencies only past max_position_embeddings and LongRoPE's past
    original_max_position_embeddings; within the artifact's context both keep their initial frequencies. Their
    data-dependent update failed torch.export ('Could not guard on data-dependent expression'; 'op aten.detach_')."""
    directory = _tiny_model(*ROPE_PER_CALL[variant], tmp_path / "model", tokenizer)
    expected = transformers_tokens(directory, tokenizer, PROMPTS[:2])
    fxllm.compile(directory, tmp_path / "ort")
    single, batched = engine_tokens(tmp_path / "ort", PROMPTS[:2])
    assert single == expected and batched == expected


def test_longrope_switching_inside_the_context_is_refused_by_name(tokenizer, tmp_path, capsys):
    """LongRoPE whose long factors start inside the context picks its frequencies from each call's largest
    position, which an artifact cannot reproduce: one line naming it (it said 'op aten.detach_.default ... is not
    understood'), nothing written."""
    directory = _tiny_model("Phi3Config", dict(**GQA, intermediate_size=96, original_max_position_embeddings=64,
                                               rope_scaling=dict(rope_type="longrope", long_factor=[2.0] * 8,
                                                                 short_factor=[1.0] * 8)),
                            tmp_path / "model", tokenizer)
    capsys.readouterr()
    assert main(["compile", str(directory), "-o", str(tmp_path / "out")]) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "LongRoPE" in lines[0] and "past position 64" in lines[0], lines
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


@pytest.mark.parametrize("arch", ["phi3", "gpt_neox"])
def test_kv_heads_on_a_fused_projection_it_cannot_regroup_is_refused(arch, tokenizer, tmp_path, capsys):
    """--kv-heads where K/V come out of a fused projection laid out per head (GPT-NeoX) or cut by slicing
    (Phi-3): the pass traced K back to the whole fused weight and failed with "shape '[4, 16, 64]' is invalid for
    input of size 12288". Now one line saying why, nothing written."""
    directory = build_model(arch, tmp_path / arch, tokenizer)
    capsys.readouterr()
    assert main(["compile", str(directory), "-o", str(tmp_path / "out"), "--kv-heads", "1"]) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "cannot regroup KV heads" in lines[0] and "compile without kv_heads" in lines[0], lines
    assert sorted(p.name for p in tmp_path.iterdir()) == [arch]


def test_a_query_scale_from_the_sequence_length_is_refused_not_compiled_wrong(tokenizer, tmp_path, capsys):
    """Llama 4's attention temperature tuning scales the queries of its NoPE layers by a function of
    `arange(tokens) + past_seen_tokens`, not of position_ids: captured without a cache, every decode step took
    position 0's scale. The kv-cache pass kept every greedy token of the drift sample (max |Δlogit| 3.7e-3 on logits
    of ~1) and the artifact diverged from transformers later; now that drift fails the compile, nothing written."""
    directory = _tiny_model("Llama4TextConfig", dict(**GQA, head_dim=16, intermediate_size=96, intermediate_size_mlp=96,
                                                     num_local_experts=2, attention_chunk_size=None,
                                                     layer_types=["full_attention"] * 2, no_rope_layers=[1, 0],
                                                     attn_temperature_tuning=True, floor_scale=2, attn_scale=0.5,
                                                     moe_layers=[1]),
                            tmp_path / "model", tokenizer)
    capsys.readouterr()
    assert main(["compile", str(directory), "-o", str(tmp_path / "out")]) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "pass 'kv-cache' should be exact but moved the logits" in lines[0], lines
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


MOE_ROUTED = dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=1,
                  n_group=1, topk_group=1)
REFUSED_BY_WHAT_THEY_DO = {  # an internal error, torch's guard text or an op name before; now what the model does
    "multi-head latent attention": ("DeepseekV3Config", dict(**GQA, **MOE_ROUTED, intermediate_size=96,
                                                              kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8,
                                                              qk_nope_head_dim=8, v_head_dim=16)),
    "more than one attention a layer": ("DiffLlamaConfig", dict(**GQA, intermediate_size=96)),
    "fixes or bounds the sequence length": ("GPTNeoConfig", dict(num_layers=2, window_size=WINDOW,
                                                                 attention_types=[[["global", "local"], 1]])),
    # torch's guard alone, without the advice on torch.export that follows it in torch's message
    "(torch.export guard: tokens != 256), e.g.": ("OpenAIGPTConfig", dict()),
    "reads a tensor's values into Python": ("JetMoeConfig", dict(num_local_experts=4, num_experts_per_tok=2,
                                                                 kv_channels=16, intermediate_size=96)),
    "layers with different head sizes": ("Gemma4TextConfig", dict(**GQA, head_dim=16, sliding_window=WINDOW,
                                                                  intermediate_size=96)),
    "complex arithmetic": ("Llama4TextConfig", dict(**GQA, head_dim=16, intermediate_size=96, intermediate_size_mlp=96,
                                                    num_local_experts=2, attention_chunk_size=None,
                                                    layer_types=["full_attention"] * 2, no_rope_layers=[1, 0],
                                                    attn_temperature_tuning=False, moe_layers=[1])),
}


@pytest.mark.parametrize("feature", list(REFUSED_BY_WHAT_THEY_DO))
def test_what_a_model_does_that_fxllm_cannot_compile_is_named(feature, tokenizer, tmp_path, capsys):
    directory = _tiny_model(*REFUSED_BY_WHAT_THEY_DO[feature], tmp_path / "model", tokenizer)
    capsys.readouterr()
    assert main(["compile", str(directory), "-o", str(tmp_path / "out")]) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fxllm: error: ") and feature in lines[0], lines
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]
