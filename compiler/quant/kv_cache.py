"""An int8 KV cache (`--kv-cache-dtype int8`, target ort): its scales, calibrated on the passes' program, and its
drift, measured on the written artifact.

Scales: the program (after the passes, float caches) prefills a few windows of a calibration text; each layer's
present K and V — what the cache holds, the rotary embedding applied — give their largest magnitude per KV head and
channel; scale = that / 127, so the calibration's own values round to codes in [-127, 127] and larger ones later
saturate. Drift: the artifact's logits through the runtime (a prefill, then three tokens over the int8 cache) against
the program's on the compiler's drift sample, the same measure as every pass's.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from fxllm.compiler.drift import Drift, Logits, compare_logits, drift_sample
from fxllm.compiler.interface import run_sequence, step_inputs
from fxllm.compiler.program import Program
from fxllm.errors import PipelineError
from fxllm.runtime.contract import CONTIGUOUS, LOGITS_INDEX, cache_output

SAMPLES, WINDOW = 4, 256  # calibration windows of the text, tokens each (fewer: a model with fewer positions)
SMALLEST = 1e-8  # a channel that is zero over the whole calibration keeps a usable scale


def check_lowers_to_quantized_attention(spec) -> None:
    """The int8 cache is GroupQueryAttention's: a layer with soft-capping or sinks lowers to standard ops instead
    (compiler/targets/onnx_translations.py), and the kernel takes only head sizes it supports. Called after the
    capture, so such a model is refused before the passes, the calibration and the lowering; the lowering's own
    check (int8-kv-cache) stays the last word."""
    from fxllm.compiler.targets.ort.group_query_attention import kernel_takes_head_dim
    from fxllm.errors import UnsupportedModelError

    kinds = {"softcap": "soft-capping", "sinks": "attention sinks"}
    found = [kinds[key] for key in kinds if any(layer.get(key) for layer in spec.layers)]
    if not kernel_takes_head_dim(spec.head_dim):
        found.append(f"a head size of {spec.head_dim}")
    if found:
        raise UnsupportedModelError(f"--kv-cache-dtype int8 needs every layer's attention as ONNX Runtime's "
                                    f"GroupQueryAttention, which this model's does not lower to ({', '.join(found)}); "
                                    "compile without it")


def calibration_windows(tokenizer, calibration: str, max_positions: int) -> tuple[torch.Tensor, str]:
    """SAMPLES windows of WINDOW tokens (fewer for a model with fewer positions) spread over the calibration text:
    [SAMPLES, window], and what they are. Called right after the capture: a text too short is refused before the
    passes (a GPTQ's minutes), not after them."""
    from fxllm.compiler.quant.calibration import TooFewTokens, read_calibration_text, spread_windows

    text, source = read_calibration_text(calibration, user="kv-cache int8")
    window = min(WINDOW, max_positions)
    try:
        windows = spread_windows(tokenizer, text, SAMPLES, window, window)
    except TooFewTokens as short:
        plural = "s" if short.tokens != 1 else ""
        raise PipelineError(f"kv-cache int8: the calibration text '{source}' has {short.tokens} token{plural}; "
                            f"calibrating the cache needs at least {window}") from None
    return torch.tensor(windows, dtype=torch.long), f"{source}, {SAMPLES} windows of {window} tokens"


def kv_cache_scales(program: Program, windows: tuple[torch.Tensor, str]) -> tuple[list[tuple[np.ndarray, np.ndarray]],
                                                                                   str]:
    """Per layer (K scale, V scale), each [kv_heads, head_dim] float32, from calibration_windows' tokens; and what
    they were calibrated on."""
    tokens, description = windows
    window = tokens.shape[1]
    inputs = step_inputs(program, tokens, {})
    for index, sig in enumerate(program.inputs):
        if sig.name == LOGITS_INDEX:  # the last position's logits only: nobody reads them
            inputs[index] = torch.tensor([window - 1])
    with torch.no_grad():
        outputs = dict(zip((sig.name for sig in program.outputs), program.graph_module(*inputs)))
    scales = []
    for layer in range(program.spec.num_layers):
        pair = []
        for kind in ("key", "value"):
            present = outputs[cache_output(CONTIGUOUS, kind, layer)].float()  # [samples, kv_heads, window, head_dim]
            largest = present.abs().amax(dim=(0, 2)).numpy()
            pair.append((np.maximum(largest, SMALLEST) / 127.0).astype(np.float32))
        scales.append((pair[0], pair[1]))
    return scales, description


def kv_cache_drift(program: Program, artifact: Path) -> Drift:
    """The artifact's drift against the program (the float-cache math) on the drift sample."""
    import fxllm

    sample = drift_sample(program.spec.vocab_size)
    reference = Logits.of(run_sequence(program, sample))
    engine = fxllm.load(artifact, threads=1, int8_activations=False)  # the cache's drift alone
    runner, rows = engine.runner, []
    split = sample.shape[1] - 3  # like run_sequence: a prefill, then three tokens over the cache
    for ids in sample.tolist():
        cache = runner.new_cache()
        first = runner.step_one(cache, ids[:split], 0, all_logits=True)
        rows.append(np.concatenate([first, runner.step_one(cache, ids[split:], split, all_logits=True)]))
    return compare_logits(reference, Logits.of(torch.from_numpy(np.stack(rows))))
