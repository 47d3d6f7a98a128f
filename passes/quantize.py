"""Pass `quantize`: weight-only quantization of linear layers (and optionally the embedding).

before: linear(x, W [out, in], b)
→ after: dequant_linear(x, Q [in, out], S, O, b, block): int8 per output channel (S [out]) or int4 in blocks of
`group_size` along the input dim (S [ceil(in/group_size), out]); symmetric (O = None), or with zero_point=true
asymmetric (a zero point per block, stored exactly as signed codes plus a per-block offset O [blocks, out]); in
ONNX DequantizeLinear → MatMul (+ the offset term). Methods: int8, int4-rtn (round to nearest), int4-gptq,
int4-awq (calibrated).
With lm_head=int8|int4 the logits linear too (blocked, also for int8); with embedding=int8|int4:
embedding(W, ids) → dequant_embedding(codes, scales, ids) (Gather of rows, then DequantizeLinear).
Mixture-of-experts routers stay float; the experts are rounded to nearest (compiler/quant/experts.py).
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch

from fxllm.compiler.quant.awq import clip_and_quantize, search_scales
from fxllm.compiler.quant.calibration import (calibration_tokens, check_calibration_source, check_sample_shape,
                                              read_calibration_text, walk_linears)
from fxllm.compiler.quant.experts import keep_gguf_experts, quantize_experts
from fxllm.compiler.quant.gptq import HessianAccumulator, gptq_quantize
from fxllm.compiler.pass_registry import register_pass
from fxllm.compiler.patterns import logits_projection
from fxllm.compiler.program import Program
from fxllm.progress import counter, progress
from fxllm.compiler.projections import constant, drop_unused_attributes
from fxllm.compiler.quant.numerics import HALF_SUFFIX, QuantFormat, dequantize_codes, relative_error, round_to_nearest
from fxllm.compiler.quant.folding import input_scale_folder
from fxllm.compiler.quant.gguf_exact import (EXACT_TYPES, FLOAT_TYPES, GGUF_BLOCK, Fallback, GGUFWeights,
                                             shared_form)
from fxllm.passes.fuse_projections import FUSED_FROM
from fxllm.runtime.checks import byte_size
from fxllm.errors import FxllmError, PipelineError

aten = torch.ops.aten
Node = torch.fx.Node
METHODS = ("int8", "int4-rtn", "int4-gptq", "int4-awq", "gguf")
CALIBRATED = ("int4-gptq", "int4-awq")
REPORT_SAMPLES = 4  # calibration samples the data-free methods use for their per-layer output errors
SIDE_MODES = ("float", "int8", "int4")  # lm_head and embedding
EMBEDDING_TYPES = ("Q8_0", "Q4_0")  # GGUF types an embedding keeps as blocks: dequant_embedding has no offsets
# (group_size, zero_point) when not given: the best measured configuration of at most 5.0 bits per weight for the
# calibrated methods (asymmetric, group 32, float16 scales: SmolLM2 AWQ +8.9% perplexity, GPTQ +13.2%, against +17.1%
# for GPTQ at asymmetric group 64 with float32 scales; see docs/quantization.md); int4-rtn keeps symmetric group 128.
METHOD_DEFAULTS = {"int4-gptq": (32, True), "int4-awq": (32, True)}


@dataclass
class QuantizedLinear:
    node: Node
    codes: torch.Tensor  # [out, in] int8 (int4 range for 4 bits)
    scales: torch.Tensor  # [groups, out] or [out]
    offsets: torch.Tensor | None  # [groups, out] (asymmetric formats) or None
    fmt: QuantFormat
    weight_error: float = 0.0
    output_error: float | None = None
    rtn_output_error: float | None = None  # round-to-nearest's output error on the same inputs, for comparison
    note: str = ""
    half_scales: bool = False  # the scales hold float16 values though fmt does not say so (GGUF blocks)


def _check_pass_options(*, method: str, group_size: int | None, lm_head: str, embedding: str, calib: str,
                        damp: float = 0.01, samples: int = 16, seq_len: int = 512, zero_point: bool | None = None,
                        **_: object) -> None:
    """Everything quantize would refuse, checked when the pipeline is built (before loading the model)."""
    _check_options(method, METHOD_DEFAULTS.get(method, (128, False))[0] if group_size is None else group_size,
                   lm_head, embedding)
    _check_zero_point(method, zero_point)
    check_calibration_source(calib)
    check_sample_shape(samples, seq_len)
    _check_damp(damp)


def _check_zero_point(method: str, zero_point: bool | None) -> None:
    if zero_point and method in ("int8", "gguf"):
        why = "int8 is symmetric per output channel" if method == "int8" else "gguf keeps the file's own blocks"
        raise PipelineError(f"quantize: zero_point applies to the int4 methods (int4-rtn, int4-gptq, int4-awq); {why}")


def _check_damp(damp: object) -> None:
    if isinstance(damp, bool) or not isinstance(damp, (int, float)) or not math.isfinite(damp) or damp < 0:
        raise PipelineError(f"quantize: damp (GPTQ's dampening, a fraction of the Hessian's mean diagonal added to "
                            f"it) must be a finite number >= 0, got {damp!r}")


def check_calibration_length(options: dict[str, Any], tokenizer, max_positions: int) -> None:
    """A calibrated method's text holds its samples' tokens (the pass's own check, calibration_tokens): the compile
    calls this right after the capture with the step's options (defaults filled in), so a text too short is refused
    before the passes, not minutes into them."""
    if options.get("method") not in CALIBRATED or tokenizer is None:
        return
    text, source = read_calibration_text(options["calib"])
    calibration_tokens(tokenizer, text, options["samples"], min(options["seq_len"], max_positions), source)


@register_pass("quantize", requires=("captured",), provides=("quantized",), forbids=("quantized", "kv-cache"),
               exact=False, check=_check_pass_options)
def quantize(program: Program, *, method: str = "int8", group_size: int | None = None, lm_head: str = "float",
             embedding: str = "float", calib: str = "shakespeare", samples: int = 16, seq_len: int = 512,
             damp: float = 0.01, act_order: bool = True, mse: bool = True, zero_point: bool | None = None) -> Program:
    """Weight-only int8 / int4 (RTN, GPTQ, AWQ) quantization of linear layers; zero_point: asymmetric int4.
    group_size / zero_point default per method (METHOD_DEFAULTS)."""
    default_group, default_zero_point = METHOD_DEFAULTS.get(method, (128, False))
    group_size = default_group if group_size is None else group_size
    _check_zero_point(method, zero_point)
    zero_point = default_zero_point if zero_point is None else zero_point
    _check_options(method, group_size, lm_head, embedding)
    _check_damp(damp)
    if method == "gguf":
        return _keep_gguf_blocks(program)
    head = _logits_linear(program)
    candidates = [n for n in program.graph.nodes if n.target is aten.linear.default and n is not head
                  and constant(program, n.args[1]) is not None]
    routers = [n for n in candidates if _routes_experts(n)]
    linears = [n for n in candidates if n not in routers]
    main_fmt = QuantFormat(8, 0) if method == "int8" else int4_format(group_size, zero_point)
    formats = {n: main_fmt for n in linears}
    if head is not None and lm_head != "float":
        formats[head] = _side_format(lm_head, group_size)
    start = time.perf_counter()
    tokens = None
    seq_len = min(seq_len, program.spec.max_positions)  # a window past the context (learned positions) cannot run
    if method in CALIBRATED:
        if program.tokenizer is None:
            raise PipelineError(f"quantize: method {method} needs calibration text, and this program has no tokenizer")
        text, source = read_calibration_text(calib)
        tokens = calibration_tokens(program.tokenizer, text, samples, seq_len, source)
    elif program.tokenizer is not None:
        tokens = _report_tokens(program, calib, min(samples, REPORT_SAMPLES), seq_len)
    results = _quantize_all(program, formats, method, tokens, damp, act_order, mse)
    layers = [_layer_report(r) for r in results]
    for index, result in enumerate(results):
        _rewrite(program, result, index)
    if embedding != "float":
        _quantize_embedding(program, _side_format(embedding, group_size))
    expert_rows, expert_notes = quantize_experts(program, main_fmt)
    if not results and not expert_rows:
        raise PipelineError("quantize: the model has no linear projection with a constant weight to quantize "
                            f"({program.spec.architecture})")
    layers += expert_rows
    program.spec.notes += [f"quantize: {note}" for note in expert_notes]
    if expert_rows and method in CALIBRATED:
        program.spec.notes.append(f"quantize: mixture-of-experts weights rounded to nearest ({method} calibrates the "
                                  "dense linears only)")
    if routers:
        program.spec.notes.append(f"quantize: {len(routers)} mixture-of-experts routers kept float")
    drop_unused_attributes(program)
    program.spec.notes.append(
        f"quantize: {method}" + (f", group size {group_size}" + (", asymmetric" if zero_point else "")
                                 if method != "int8" else ", per channel")
        + f", lm_head {lm_head}, embedding {embedding}" + (f", calibration {calib} {samples}x{seq_len}" if method in
                                                            CALIBRATED else ""))
    program.diagnostics = {"layers": layers,
                           "seconds": round(time.perf_counter() - start, 2)}
    return program


def _report_tokens(program: Program, calib: str, samples: int, seq_len: int) -> torch.Tensor | None:
    """A few calibration samples on which data-free methods report each layer's output error; None (no report)
    when no text is at hand — rounding itself needs none, so this never fails the compile nor downloads."""
    from fxllm.datasets import dataset_cached, dataset_names

    if calib in dataset_names() and not dataset_cached(calib):
        return None
    try:
        text, source = read_calibration_text(calib)
        return calibration_tokens(program.tokenizer, text, samples, seq_len, source)
    except FxllmError:
        return None


def _routes_experts(linear: torch.fx.Node, depth: int = 8) -> bool:
    """Whether a linear is a mixture-of-experts router: its output reaches a top-k within `depth` nodes (linear →
    softmax → topk, or with a bias, a sigmoid, a cast between). Routers stay float, as AutoAWQ and llama.cpp keep
    them: they are [experts × hidden], a rounding of their logits moves tokens to other experts (a discrete error),
    and the experts themselves see the tokens the float router chose."""
    frontier, seen = [linear], set()
    for _ in range(depth):
        frontier = [user for node in frontier for user in node.users if user not in seen]
        seen.update(frontier)
        if any(node.target is aten.topk.default for node in frontier):
            return True
    return False


def _check_options(method: str, group_size: int, lm_head: str, embedding: str) -> None:
    if method not in METHODS:
        raise PipelineError(f"unknown quantize method '{method}' (available: {', '.join(METHODS)})")
    if group_size < 16 or group_size & (group_size - 1):
        raise PipelineError(f"quantize: group_size must be a power of two >= 16, got {group_size}")
    for name, value in (("lm_head", lm_head), ("embedding", embedding)):
        if value not in SIDE_MODES:
            raise PipelineError(f"quantize: {name} must be one of {', '.join(SIDE_MODES)}, got '{value}'")


def int4_format(group_size: int, zero_point: bool) -> QuantFormat:
    """The int4 methods' format: blocks of `group_size` input rows, float16 scales (llama.cpp's and AutoGPTQ's
    width: half the bits of float32 scales for a rounding of the scale far below the code's)."""
    return QuantFormat(4, group_size, symmetric=not zero_point, half_scales=True)


def _side_format(mode: str, group_size: int) -> QuantFormat:
    # Blocked even for int8: ONNX Runtime runs blocked int8 DQ→MatMul as MatMulNBits, per-channel int8 it does not.
    return QuantFormat(8 if mode == "int8" else 4, group_size, half_scales=True)


def _logits_linear(program: Program) -> Node | None:
    return logits_projection(program.output_node().args[0][0], {aten.linear.default})


def _quantize_all(program: Program, formats: dict[Node, QuantFormat], method: str, tokens: torch.Tensor | None,
                  damp: float, act_order: bool, mse: bool) -> list[QuantizedLinear]:
    """Without calibration each layer is rounded on its own; with it, layers are visited in graph order on the
    calibration activations, each seeing the outputs of the already-quantized layers before it."""
    if not formats:  # nothing for the walk to stop at (an MoE model's experts are quantized apart)
        return []
    if tokens is None:
        results = []
        for node in progress(list(formats), desc="quantize", unit="layer"):
            weight = constant(program, node.args[1]).detach()
            results.append(_with_errors(QuantizedLinear(node, *round_to_nearest(weight, formats[node]), formats[node]),
                                        weight, None))
        return results
    done: dict[Node, QuantizedLinear] = {}
    bar = counter(len(formats), desc=f"quantize {method}", unit="layer")

    def visit(group: list[Node], x: torch.Tensor, need_outputs: bool) -> dict[Node, torch.Tensor]:
        outputs = {}
        quantized = (_calibrated_group(program, group, x, formats, method, damp, act_order, mse, done)
                     if method in CALIBRATED else _rounded_group(program, group, x, formats))
        for node, result, x_used in quantized:
            done[node] = result
            if not need_outputs:
                continue
            weight = dequantize_codes(result.codes, result.scales, result.fmt, result.offsets)
            bias = constant(program, node.args[2]) if len(node.args) > 2 and node.args[2] is not None else None
            outputs[node] = torch.nn.functional.linear(x_used, weight, bias)
        return outputs

    walk_linears(program, tokens, list(formats), visit, on_done=bar.update)
    bar.close()
    return [done[n] for n in formats]


def _rounded_group(program: Program, group: list[Node], x: torch.Tensor, formats: dict[Node, QuantFormat]):
    """Round to nearest (the weights alone decide); x only measures the output error."""
    for node in group:
        weight = constant(program, node.args[1]).detach()
        result = QuantizedLinear(node, *round_to_nearest(weight, formats[node]), formats[node])
        yield node, _with_errors(result, weight, x, compare_rtn=False), x


def _calibrated_group(program: Program, group: list[Node], x: torch.Tensor, formats: dict[Node, QuantFormat],
                      method: str, damp: float, act_order: bool, mse: bool, done: dict[Node, QuantizedLinear]):
    """Quantize linears that read the same x; yields (node, result, the input their outputs are computed from)."""
    if method == "int4-gptq":
        hessian = HessianAccumulator(x.shape[-1])
        hessian.add(x)
        for node in group:
            weight = constant(program, node.args[1]).detach()
            quantized = gptq_quantize(weight, hessian.hessian, formats[node], damp=damp, act_order=act_order, mse=mse)
            yield node, _with_errors(QuantizedLinear(node, *quantized, formats[node]), weight, x), x
        return
    weights = {node: constant(program, node.args[1]).detach() for node in group}
    folder = input_scale_folder(program, group, done)
    search = search_scales(x, torch.cat(list(weights.values())), formats[group[0]]) if folder else None
    if search is not None:
        folder(search.scales)  # the producer of x now emits x / s
        x = x / search.scales
    for node, weight in weights.items():
        scaled = weight * search.scales if search is not None else weight
        quantized = clip_and_quantize(x, scaled, formats[node])
        if search is None:
            note = "awq clipping only (input scale not foldable)"
        else:
            note = f"awq α={search.ratio:.2f}" if search.ratio is not None else "awq s=1 (no scaling won)"
        result = QuantizedLinear(node, *quantized, formats[node], note=note)
        yield node, _with_errors(result, weight, x, search.scales if search is not None else None), x


def _with_errors(result: QuantizedLinear, weight: torch.Tensor, x: torch.Tensor | None,
                 input_scales: torch.Tensor | None = None, compare_rtn: bool = True) -> QuantizedLinear:
    """Relative weight error, and relative output error on the calibration inputs x (the inputs the layer really
    receives, after earlier layers were quantized), both in the float layer's own terms; with compare_rtn also
    round-to-nearest's output error on the same inputs (pointless when the result is round-to-nearest itself)."""
    dequantized = dequantize_codes(result.codes, result.scales, result.fmt, result.offsets)
    # AWQ: the layer applies Q·diag(1/s) to x, and receives x / s
    result.weight_error = relative_error(weight, dequantized / input_scales if input_scales is not None
                                         else dequantized)
    if x is not None:
        rows = x.reshape(-1, x.shape[-1])
        rows = rows[torch.linspace(0, len(rows) - 1, min(2048, len(rows))).long()]
        reference = rows * input_scales if input_scales is not None else rows  # the float layer's input
        expected = reference @ weight.t()
        result.output_error = relative_error(expected, rows @ dequantized.t())
        if compare_rtn:
            codes, scales, offsets = round_to_nearest(weight, result.fmt)
            rtn = dequantize_codes(codes, scales, result.fmt, offsets)
            result.rtn_output_error = relative_error(expected, reference @ rtn.t())
    return result


def _weight_label(node: Node) -> str:
    """'model.layers.3.self_attn.q_proj+k_proj+v_proj' for a fused projection, else the weight's name."""
    names = [n.removesuffix(".weight") for n in node.meta.get(FUSED_FROM, [str(node.args[1].target)])]
    prefix = names[0].rpartition(".")[0]
    if len(names) > 1 and all(n.rpartition(".")[0] == prefix for n in names):
        return prefix + "." + "+".join(n.rpartition(".")[2] for n in names)
    return "+".join(names)


def _layer_report(result: QuantizedLinear) -> dict:
    return {"layer": result.node.name, "weight": _weight_label(result.node),
            "shape": list(result.codes.shape), "bits": result.fmt.bits, "group_size": result.fmt.group_size,
            "symmetric": result.fmt.symmetric,
            "bits_per_weight": round(result.fmt.bits_per_weight(result.codes.shape[1], result.codes.shape[0]), 4),
            "weight_error": round(result.weight_error, 6),
            "output_error": None if result.output_error is None else round(result.output_error, 6),
            "rtn_output_error": None if result.rtn_output_error is None else round(result.rtn_output_error, 6),
            "note": result.note}


def _rewrite(program: Program, result: QuantizedLinear, index: int) -> tuple[str, str]:
    """linear → dequant_linear on new buffers; → the names of its codes and scales buffers."""
    graph, node = program.graph, result.node
    prefix = f"quantized_{index}"
    codes = f"{prefix}_int{result.fmt.bits}_codes"  # lowering packs the *_int4_codes two per byte
    scales = f"{prefix}_scales" + (HALF_SUFFIX if result.half_scales or result.fmt.half_scales else "")
    program.graph_module.register_buffer(codes, result.codes.t().contiguous())
    program.graph_module.register_buffer(scales, result.scales.contiguous())
    if result.offsets is not None:
        program.graph_module.register_buffer(f"{prefix}_offsets", result.offsets.contiguous())
    bias = node.args[2] if len(node.args) > 2 else None
    with graph.inserting_before(node):
        offsets = graph.get_attr(f"{prefix}_offsets") if result.offsets is not None else None
        replacement = graph.call_function(torch.ops.fxllm.dequant_linear.default, (
            node.args[0], graph.get_attr(codes), graph.get_attr(scales), offsets, bias, result.fmt.group_size))
    node.replace_all_uses_with(replacement)
    graph.erase_node(node)
    return codes, scales


def unpacked_codes_name(prefix: str, bits: int) -> str:
    """The buffer of an embedding's codes: one per byte whatever their width (ONNX's Gather has no INT4 type), so
    not `*_int4_codes`, which lowering packs two per byte; the width stays in the name (`fxllm inspect` reads it)."""
    return f"{prefix}_int{bits}_unpacked_codes"


def _quantize_embedding(program: Program, fmt: QuantFormat) -> None:
    """embedding(W [vocab, hidden], ids) → dequant_embedding(codes, scales, ids): rows quantized in blocks of the
    hidden dim (int4 codes are stored one per byte: ONNX's Gather has no INT4 type)."""
    graph = program.graph
    for index, node in enumerate([n for n in graph.nodes if n.target is aten.embedding.default]):
        weight = constant(program, node.args[0])
        if weight is None:
            continue
        codes, scales, _ = round_to_nearest(weight.detach(), fmt)  # rows are the "output channels" here
        name = unpacked_codes_name(f"embedding_{index}", fmt.bits)
        program.graph_module.register_buffer(name, codes)
        program.graph_module.register_buffer(f"embedding_{index}_scales", scales.t().contiguous())
        with graph.inserting_before(node):
            replacement = graph.call_function(torch.ops.fxllm.dequant_embedding.default, (
                graph.get_attr(name), graph.get_attr(f"embedding_{index}_scales"),
                node.args[1], fmt.group_size))
        node.replace_all_uses_with(replacement)
        graph.erase_node(node)


def _keep_gguf_blocks(program: Program) -> Program:
    """method gguf: every linear, MoE expert weight and embedding whose GGUF tensors are of an exact type takes
    those blocks as stored (compiler/quant/gguf_exact.py); a tied embedding reads the lm_head's blocks (one stored
    copy). Weights of other quantized types keep transformers' float weights, and the compile says which and why (a
    printed warning per reason, FALLBACK_REASONS)."""
    if program.source_file is None:
        raise PipelineError("quantize: method gguf keeps a GGUF file's own blocks, and this model was not loaded "
                            "from a GGUF file")
    weights = GGUFWeights(program.source_file, program.spec.num_layers)
    start = time.perf_counter()
    kept: dict[str, tuple[str, str]] = {}  # GGUF tensor name → (codes, scales) buffers of the layer holding it
    layers, fallbacks = _keep_gguf_linears(program, weights, kept)
    expert_rows, expert_fallbacks = keep_gguf_experts(program, weights)
    layers += expert_rows
    fallbacks += expert_fallbacks
    for node in [n for n in program.graph.nodes if n.target is aten.embedding.default]:
        fallback = _keep_gguf_embedding(program, node, weights, kept)
        fallbacks += [fallback] if fallback is not None else []
    drop_unused_attributes(program)
    note = f"quantize: gguf, {len(layers)} layers keep {weights.path.name}'s blocks"
    warnings = _fallback_warnings(fallbacks, weights)
    for warning in warnings:
        print(f"fxllm: warning: {warning}", file=sys.stderr)
        note += f"; {warning}"
    program.spec.notes.append(note)
    program.diagnostics = {"layers": layers, "fallbacks": {f.weight: f.type_name for f in fallbacks},
                           "warnings": warnings, "seconds": round(time.perf_counter() - start, 2)}
    return program


def _keep_gguf_linears(program: Program, weights: GGUFWeights, kept: dict[str, tuple[str, str]]
                       ) -> tuple[list[dict], list[Fallback]]:
    """Every linear with a constant weight whose GGUF parts share a block form (`shared_form`) → dequant_linear of
    those blocks; `kept` gets each unfused layer's buffers by GGUF tensor name. → (report rows, fallbacks)."""
    spec = program.spec
    kv_heads = spec.source_num_kv_heads or spec.num_kv_heads
    layers, fallbacks = [], []
    linears = [n for n in program.graph.nodes if n.target is aten.linear.default
               and constant(program, n.args[1]) is not None]
    for index, node in enumerate(linears):
        names = node.meta.get(FUSED_FROM, [str(node.args[1].target)])
        types = [weights.type_of(name) for name in names]
        form = shared_form(types)
        if form is None:
            fallbacks += _linear_fallbacks(node, names, types, weights)
            continue
        reference = constant(program, node.args[1]).detach()
        parts, row = [], 0
        for name in names:
            rows = int(weights.tensors[weights.gguf_name(name)].shape[1])
            part = weights.blocks(name, reference[row:row + rows], spec.num_heads, kv_heads)
            parts.append(part.with_offsets() if form == "Q4_1" else part)
            row += rows
        offsets = None if parts[0].offsets is None else torch.cat([p.offsets for p in parts], 1)
        kinds = "+".join(dict.fromkeys(p.type_name for p in parts))
        result = QuantizedLinear(node, torch.cat([p.codes for p in parts]), torch.cat([p.scales for p in parts], 1),
                                 offsets, parts[0].fmt, note=f"gguf {kinds} kept", half_scales=True)
        result.weight_error = relative_error(reference, torch.cat([p.dequantize() for p in parts]))
        layers.append(_layer_report(result))
        buffers = _rewrite(program, result, index)
        if len(names) == 1:
            kept[weights.gguf_name(names[0])] = buffers
    return layers, fallbacks


def _linear_fallbacks(node: Node, names: list[str], types: list[str | None], weights: GGUFWeights
                      ) -> list[Fallback]:
    """Why each quantized part of a linear left float stays float: its type has no exact form, or (a fused
    projection's part) its siblings' types share no block form with it."""
    fallbacks = []
    for name, kind in zip(names, types):
        if kind in FLOAT_TYPES:
            continue
        reason = "fused" if kind in EXACT_TYPES else "no-form"
        label = _weight_label(node) + f" ({'/'.join(map(str, types))})" if reason == "fused" else name
        tensor = weights.gguf_name(name)
        fallbacks.append(Fallback(name, [tensor] if tensor else [], str(kind), reason, label=label))
    return fallbacks


def _keep_gguf_embedding(program: Program, node: Node, weights: GGUFWeights, kept: dict[str, tuple[str, str]]
                         ) -> Fallback | None:
    """A Q8_0 embedding tied to a kept lm_head reads its blocks; an untied (or Q4_0) one keeps its own. → the
    Fallback when it stays float (other quantized types), else None."""
    weight_name = str(node.args[0].target)
    name, kind = weights.gguf_name(weight_name), weights.type_of(weight_name)
    if name in kept and kind == "Q8_0":  # tied: the lm_head's own blocks
        codes, scales = kept[name]
        with program.graph.inserting_before(node):
            replacement = program.graph.call_function(torch.ops.fxllm.dequant_embedding.default, (
                program.graph.get_attr(codes), program.graph.get_attr(scales), node.args[1], GGUF_BLOCK, True))
        node.replace_all_uses_with(replacement)
        program.graph.erase_node(node)
    elif kind in EMBEDDING_TYPES:  # an untied embedding of its own
        _keep_embedding_blocks(program, node, weights)
    elif kind not in FLOAT_TYPES:
        return Fallback(weight_name, [name] if name else [], str(kind),
                        "embedding" if kind in EXACT_TYPES else "no-form", label=name or weight_name)
    return None


# Why GGUF tensors stayed float (Fallback.reason) → the middle of the warning "N GGUF tensors of type T ...".
FALLBACK_REASONS = {
    "no-form": "have no exact form here (fxllm keeps Q4_0, Q4_1 and Q8_0 blocks)",
    "fused": "are parts of fused projections whose parts share no block form (one fused weight is one form: "
             "Q4_0 and Q4_1 mix, Q8_0 and 4-bit types do not; a --passes list without fuse-projections, with "
             "quantize:method=gguf, keeps each part's own blocks)",
    "embedding": "are token embeddings, whose blocks fxllm keeps for Q8_0 and Q4_0 only (its embedding lookup has "
                 "no per-block offsets; Q4_1 linears, a tied lm_head included, keep their blocks)",
    "experts-fused": "are MoE gate and up experts of block forms that do not mix (transformers fuses the two into "
                     "one weight, which is one form: Q4_0 and Q4_1 mix, Q8_0 and 4-bit types do not)",
    "experts-layout": "are MoE expert weights in a layout fxllm does not map to GGUF blocks",
}


def _fallback_warnings(fallbacks: list[Fallback], weights: GGUFWeights) -> list[str]:
    """One line per reason: how many tensors of which types, their bytes in the file and as float32, an example."""
    lines = []
    for reason, why in FALLBACK_REASONS.items():
        group = [f for f in fallbacks if f.reason == reason]
        if not group:
            continue
        tensors = list(dict.fromkeys(t for f in group for t in f.tensors or [f.weight]))
        stored, as_float = weights.sizes(tensors)
        types = sorted({t for f in group for t in f.type_name.split("+")})
        lines.append(f"{len(tensors)} GGUF tensors of type {', '.join(types)} {why}; they were dequantized to float "
                     f"by transformers instead: exact values, stored as float32 ({byte_size(as_float)} instead of the "
                     f"file's {byte_size(stored)}; e.g. {group[0].label or group[0].weight})")
    return lines


def _keep_embedding_blocks(program: Program, node: Node, weights: GGUFWeights) -> None:
    """embedding(W, ids) → dequant_embedding of the GGUF's own symmetric blocks of W (codes [vocab, hidden] one per
    byte, as ONNX's Gather needs; float16 scales [vocab, hidden / 32])."""
    name = str(node.args[0].target)
    blocks = weights.blocks(name, constant(program, node.args[0]).detach(), 1, 1)
    prefix = f"gguf_embedding_{node.name}"
    codes = unpacked_codes_name(prefix, blocks.fmt.bits)
    program.graph_module.register_buffer(codes, blocks.codes.contiguous())
    program.graph_module.register_buffer(f"{prefix}_scales{HALF_SUFFIX}", blocks.scales.t().contiguous())
    graph = program.graph
    with graph.inserting_before(node):
        replacement = graph.call_function(torch.ops.fxllm.dequant_embedding.default, (
            graph.get_attr(codes), graph.get_attr(f"{prefix}_scales{HALF_SUFFIX}"), node.args[1],
            blocks.fmt.group_size))
    node.replace_all_uses_with(replacement)
    graph.erase_node(node)
