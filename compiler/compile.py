"""compile_model: source → capture → passes → ONNX → artifact directory. The one place the phases are wired."""

from __future__ import annotations

import os
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from fxllm.runtime.artifact import check_output, staging_directory, write_manifest
from fxllm.runtime.write_leftovers import remove_leftovers
from fxllm.compiler.dump import clear_previous_dump
from fxllm.compiler.gguf_cache import sharing_gguf_readers
from fxllm.compiler.pass_manager import PassRecord, run_pipeline
from fxllm.compiler.draft import (SELF_INT4_PASSES, check_draft_source, check_layers, check_same_tokenizer,
                                  check_same_vocab, parse_draft, truncate_layers)
from fxllm.compiler.pipeline import build_pipeline, check_dtype, parse_pipeline, place_dtype, place_quantization
from fxllm.progress import status
from fxllm.compiler.source_checks import check_supported, gguf_header
from fxllm.compiler.sources import (ModelSource, custom_code_ignored, load_model, load_tokenizer, resolve_source,
                                    tokenizer_origin)
from fxllm.errors import ArtifactError, ModelSourceError, PipelineError, UnsupportedModelError
from fxllm.runtime.checks import describe
from fxllm.runtime.checks import path as path_argument
from fxllm.runtime.contract import TARGETS

MODEL_FILE = "model.onnx"
TORCH_MODEL_FILE = "model.pt2"
DRAFT_DIR = "draft"
TOKENIZER_DIR = "tokenizer"
KV_CACHE_CALIBRATION = "shakespeare"  # the int8 KV cache's calibration text unless one is given


@dataclass
class CompileReport:
    output: Path
    seconds: dict[str, float] = field(default_factory=dict)
    records: list[PassRecord] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # e.g. why no TensorRT engine was built
    lowering_steps: dict[str, float] = field(default_factory=dict)  # the "lower" phase, step by step
    kv_cache: dict[str, Any] | None = None  # an int8 KV cache: its calibration and drift (as in the manifest)

    @property
    def total_seconds(self) -> float:
        return sum(self.seconds.values())


@sharing_gguf_readers  # one parse of each GGUF file the compile reads (compiler/gguf_cache.py)
def compile_model(
    model: str | os.PathLike,
    output: str | os.PathLike,
    passes: str | list[str] | None = None,
    pass_options: dict[str, dict[str, Any]] | None = None,
    dump_dir: str | os.PathLike | None = None,
    target: str = "ort",
    draft: str | None = None,
    spec_k: int = 4,
    keep_layers: int | None = None,
    quant: str | None = None,
    quant_options: dict[str, Any] | None = None,
    requantize: bool = False,
    int8_activations: bool = False,
    dtype: str = "float32",
    ort_steps: tuple[str, ...] | list[str] | None = None,
    kv_cache_dtype: str = "auto",
    kv_cache_calib: str | None = None,
) -> CompileReport:
    """Compile MODEL into the artifact directory OUTPUT; arguments are checked before any expensive work, and so is
    OUTPUT: it is replaced only when it is an fxllm artifact holding nothing else (runtime/artifact.py check_output),
    and the hidden staging directory next to it is created first, so an unwritable location fails at once. A
    failure or an interruption (SIGINT, SIGTERM, SIGHUP: Interrupted) removes the staging directory and leaves
    OUTPUT as it was; what a SIGKILLed compile to OUTPUT left next to it is cleaned up first, with a note on
    stderr (runtime/write_leftovers.py). With `draft` (see compiler/draft.py) the artifact also holds a draft model
    for speculative decoding with `spec_k` proposed tokens per step. `keep_layers` keeps only the first N decoder layers
    (self-layers drafts). `quant` (int8, int4-rtn, int4-gptq, int4-awq) with `quant_options` (group_size, calib,
    lm_head, embedding, zero_point) adds the quantize pass (see pipeline.place_quantization). A GGUF source keeps its
    own quantized blocks exactly under the default pipeline unless `requantize`. `int8_activations` makes a
    quantized artifact recommend int8 matmul activations at run time (faster, less exact); the default is float
    activations, the math the drift report measured. `dtype` (float32, float16, bfloat16; targets torch and
    tensorrt) runs the finished graph in half precision (the `dtype` pass, appended last). `ort_steps` (target ort)
    names the ONNX Runtime legalization steps to run (compiler/targets/ort; default all, () none: the standard
    form). `kv_cache_dtype` "int8" (target ort, contiguous cache) stores the KV cache as int8 codes with per-channel
    scales calibrated on `kv_cache_calib` (a text file or a named dataset, default shakespeare; given without the
    int8 cache it is refused, like --calib without a calibrated method; compiler/quant/kv_cache.py): a quarter of
    the cache's memory, its drift measured on the artifact and recorded in the manifest; "auto" keeps the model's
    dtype."""
    from fxllm import __version__
    from fxllm.compiler.capture import capture

    model = path_argument("model", model, ModelSourceError, utf8=False)  # a GGUF reads from any path
    output = path_argument("output", output, ArtifactError)  # onnx.checker, ONNX Runtime: UTF-8 paths only
    if dump_dir is not None:
        dump_dir = path_argument("dump_dir", dump_dir, PipelineError, utf8=False)  # written by Python alone
    _check_plain_options(passes, keep_layers, requantize, int8_activations)
    if target not in TARGETS:
        raise PipelineError(f"unknown target '{target}' (available: {', '.join(TARGETS)})")
    source = resolve_source(model)
    passes, pass_options = place_quantization(passes, pass_options, quant, quant_options,
                                              gguf=bool(source.gguf_file), requantize=requantize)
    passes = place_dtype(passes, dtype)
    steps = build_pipeline(parse_pipeline(passes), pass_options)
    provided = {fact for step in steps for fact in step.info.provides}
    if "kv-cache" not in provided:
        raise PipelineError("the pipeline must include 'kv-cache': the runtime decodes through a KV cache")
    if int8_activations and "quantized" not in provided:  # else the flag would be dropped without a word
        raise PipelineError("--int8-activations applies to quantized artifacts (--quant METHOD, or a GGUF's own "
                            "blocks); this pipeline quantizes nothing")
    check_dtype(steps, target, gguf=bool(source.gguf_file))
    if ort_steps is not None:
        _check_ort_steps(ort_steps, target)
    kv_cache_calib = _check_kv_cache_dtype(kv_cache_dtype, kv_cache_calib, target, provided, ort_steps)
    draft_spec = parse_draft(draft, spec_k) if draft is not None else None
    if draft_spec is not None and draft_spec.mode == "self-int4" and source.gguf_file and not requantize:
        raise PipelineError("--draft self-int4 quantizes the target's float weights to int4 for its draft, and this "
                            "GGUF target keeps its own quantized blocks (it would decode about as fast as that "
                            "draft): add --requantize for a float target with an int4 draft, or use --draft "
                            "self-layers:N, ngram or a smaller model")
    draft_source = resolve_source(draft_spec.model) if draft_spec and draft_spec.mode == "model" else None
    check_supported(source)
    if draft_source is not None:
        check_draft_source(source, draft_source, draft_spec)
    resolved_output = check_output(output)
    dump_lock = _check_dump_dir(dump_dir, resolved_output)  # held (closed) by the with-block below
    report = CompileReport(Path(output))
    float_gguf = _float_gguf_note(source, steps, requantize)
    if float_gguf:
        print(f"fxllm: note: {float_gguf}", file=sys.stderr)
        report.notes.append(float_gguf)

    def timed(phase: str, message: str, function, *args, **kwargs):
        status(message)
        start = time.perf_counter()
        result = function(*args, **kwargs)
        report.seconds[phase] = time.perf_counter() - start
        return result

    for cleaned in remove_leftovers(resolved_output):  # what SIGKILLed compiles to this output left behind
        print(f"fxllm: note: {cleaned}", file=sys.stderr)
    late_signals: list[int] = []
    with dump_lock or nullcontext(), \
            staging_directory(output, late_signals) as stage:  # also turns SIGINT/SIGTERM/SIGHUP into Interrupted
        torch_model = timed("load", f"loading {source.name}", load_model, source)
        tokenizer = load_tokenizer(source)
        _save_tokenizer(tokenizer, stage / TOKENIZER_DIR, source)
        for warning in (_tokenizer_beyond_vocabulary(tokenizer, torch_model),
                        custom_code_ignored(source, type(torch_model).__name__)):
            if warning:
                print(f"fxllm: warning: {warning}", file=sys.stderr)
                report.notes.append(warning)
        if draft_spec is not None:
            check_layers(draft_spec, torch_model.config.num_hidden_layers)
            if draft_source is not None:
                check_same_tokenizer(tokenizer, load_tokenizer(draft_source), draft_spec.model)
        if keep_layers is not None:
            if keep_layers > torch_model.config.num_hidden_layers:  # else a capture error about attention nodes
                raise PipelineError(f"keep_layers={keep_layers} keeps more layers than the model's "
                                    f"{torch_model.config.num_hidden_layers}")
            truncate_layers(torch_model, keep_layers)
        captured = timed("capture", "capturing with torch.export", capture, torch_model)
        for step in steps:
            if step.name == "quantize":  # a calibration text too short: refused now, not minutes into the passes
                from fxllm.passes.quantize import check_calibration_length

                check_calibration_length({**step.info.option_defaults, **step.options}, tokenizer,
                                         captured.program.spec.max_positions)
        kv_windows = None
        if kv_cache_dtype == "int8":
            from fxllm.compiler.quant.kv_cache import calibration_windows, check_lowers_to_quantized_attention

            check_lowers_to_quantized_attention(captured.program.spec)
            kv_windows = calibration_windows(tokenizer, kv_cache_calib, captured.program.spec.max_positions)
        captured.program.tokenizer = tokenizer
        if source.gguf_file:
            captured.program.source_file = source.directory / source.gguf_file
        program, report.records = timed(
            "passes", f"running passes: {', '.join(s.name for s in steps)}", run_pipeline, captured.program, steps,
            str(dump_dir) if dump_dir else None,
        )
        model_file = TORCH_MODEL_FILE if target == "torch" else MODEL_FILE
        signature, legalized = (program.inputs, program.outputs), None
        kv_scales = kv_calibrated = None
        if kv_cache_dtype == "int8":
            from fxllm.compiler.quant.kv_cache import kv_cache_scales

            kv_scales, kv_calibrated = timed("kv-calibration", "calibrating the int8 KV cache", kv_cache_scales,
                                             program, kv_windows)
            program.spec.kv_cache_dtype = "int8"
        if target == "torch":
            from fxllm.compiler.targets.torch_export import lower_to_torch

            timed("lower", "saving the torch.export program (target torch)", lower_to_torch, program,
                  stage / model_file, report.lowering_steps)
        else:
            from fxllm.compiler.targets.onnx_export import lower_to_onnx

            lowered = timed("lower", f"lowering to ONNX (target {target})", lower_to_onnx, program,
                            stage / model_file, target, report.lowering_steps,
                            tuple(ort_steps) if ort_steps is not None else None, kv_scales)
            signature, legalized = (lowered.inputs, lowered.outputs), lowered.legalized
        if target == "tensorrt":
            report.notes += _audit_for_tensorrt(stage / model_file)
        speculative = None
        if draft_spec is not None:
            speculative = _compile_draft(draft_spec, model, stage, program.spec.vocab_size, spec_k, report,
                                         requantize)
        manifest = {
            "fxllm_version": __version__,
            "source": {"name": source.name, "gguf": bool(source.gguf_file)},
            "target": target,
            "model_file": model_file,
            "tokenizer_dir": TOKENIZER_DIR,
            "spec": program.spec.to_dict(),
            "facts": sorted(program.facts),
            "passes": [
                {"name": r.name, "options": r.options, "seconds": round(r.seconds, 4), "drift": r.drift.to_dict()}
                for r in report.records
            ],
            "io": {
                "inputs": [sig.to_dict() for sig in signature[0]],
                "outputs": [sig.to_dict() for sig in signature[1]],
            },
            "lowering": {"ort_legalized": legalized} if legalized is not None else {},
            "compile_seconds": {k: round(v, 2) for k, v in report.seconds.items()}
            | {f"lower/{k}": round(v, 2) for k, v in report.lowering_steps.items()},
            # Float activations by default: int8 ones (MatMulNBits accuracy level 4) are faster on ONNX Runtime CPU but
            # flipped SmolLM2's greedy answer to the README's question into garbage (perplexity +0.6%); opt-in only.
            "runtime": {"int8_activations": int8_activations and "quantized" in program.facts},
            "speculative": speculative,
        }
        write_manifest(stage, manifest)
        if kv_scales is not None:
            from fxllm.compiler.quant.kv_cache import kv_cache_drift

            drift = timed("kv-drift", "measuring the int8 KV cache's drift", kv_cache_drift, program, stage)
            report.kv_cache = {"dtype": "int8", "calibration": kv_calibrated, "drift": drift.to_dict()}
            manifest["lowering"] = manifest["lowering"] | {"kv_cache": report.kv_cache}
            write_manifest(stage, manifest)
    if target == "tensorrt" and not late_signals:  # a signal came as the artifact was put in place: stop here
        _try_engine_build(report)
    return report


def _check_ort_steps(ort_steps, target: str) -> None:
    from fxllm.compiler.targets.ort import STEP_NAMES

    if target != "ort":
        raise PipelineError(f"ort_steps applies to target 'ort' only (not '{target}')")
    if not isinstance(ort_steps, (list, tuple)) or not all(isinstance(step, str) for step in ort_steps):
        raise PipelineError(f"ort_steps must be a list of step names (strings), got {describe(ort_steps)}")
    unknown = sorted(set(ort_steps) - set(STEP_NAMES))
    if unknown:
        raise PipelineError(f"unknown ort legalization step(s) {', '.join(unknown)} (available: "
                            f"{', '.join(STEP_NAMES)})")


def _check_kv_cache_dtype(kv_cache_dtype: Any, calibration: Any, target: str, provided: set[str],
                          ort_steps) -> str | None:
    """An int8 KV cache is GroupQueryAttention's (target ort) over a contiguous cache: refused otherwise, before
    any work, like a calibration source that cannot be read. → the calibration source (None without the cache)."""
    from fxllm.runtime.contract import KV_CACHE_DTYPES

    if not isinstance(kv_cache_dtype, str) or kv_cache_dtype not in KV_CACHE_DTYPES:
        raise PipelineError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got "
                            f"{describe(kv_cache_dtype)}")
    if kv_cache_dtype == "auto":
        if calibration is not None:  # else it would be ignored without a word
            raise PipelineError("--kv-cache-calib applies to --kv-cache-dtype int8 (the KV cache is float here)")
        return None
    if target != "ort":
        raise PipelineError(f"--kv-cache-dtype int8 is ONNX Runtime's quantized GroupQueryAttention cache: target "
                            f"'ort' only (not '{target}')")
    if "paged" in provided:
        raise PipelineError("--kv-cache-dtype int8 applies to the contiguous cache; the paged pool stays float32 "
                            "(drop the paged pass or the option)")
    if ort_steps is not None and not {"group-query-attention", "int8-kv-cache"} <= set(ort_steps):
        raise PipelineError("--kv-cache-dtype int8 needs the ort steps group-query-attention and int8-kv-cache")
    from fxllm.compiler.quant.calibration import check_calibration_source

    if calibration is None:
        calibration = KV_CACHE_CALIBRATION
    if not isinstance(calibration, str):
        raise PipelineError(f"kv_cache_calib must be a text file or a dataset name, got {describe(calibration)}")
    check_calibration_source(calibration, user="kv-cache int8")
    return calibration


def _float_gguf_note(source, steps: list, requantize: bool) -> str | None:
    """What a GGUF compiled with a pass list that has no quantize pass becomes: float32 weights (its Q4_0 / Q4_1 /
    Q8_0 blocks, which the default pipeline keeps, dequantized), several times the file's size, which nothing else in
    the output says; None otherwise (a float GGUF, --requantize, a quantize pass in the list)."""
    if not source.gguf_file or requantize or any(step.name == "quantize" for step in steps):
        return None
    from fxllm.compiler.quant.gguf_exact import EXACT_TYPES

    # the header check_supported has read (shared within the compile: compiler/gguf_cache.py)
    kept = sum(tensor.tensor_type.name in EXACT_TYPES for tensor in gguf_header(source).tensors)
    if not kept:  # a float GGUF: nothing would have been kept
        return None
    return (f"this pass list has no quantize pass, so the GGUF's {kept} quantized tensors that the default pipeline "
            "keeps as their blocks are dequantized to float32 weights (a larger artifact than the file); add "
            "quantize:method=gguf before kv-cache to keep them exactly, or --requantize to say float is meant")


def _check_plain_options(passes: Any, keep_layers: Any, requantize: Any, int8_activations: Any) -> None:
    """compile_model's arguments that nothing else checks before the work: refused by type, as PipelineError. A
    flag that is not a bool was written into the manifest as it came (int8_activations=None made an artifact that
    no load accepts), and passes=5 or keep_layers='1' failed as TypeErrors, the latter after the capture."""
    if passes is not None and not isinstance(passes, (str, list, tuple)):
        raise PipelineError(f"passes must be a comma-separated string or a list of pass names, got {describe(passes)}")
    for name, value in (("requantize", requantize), ("int8_activations", int8_activations)):
        if not isinstance(value, bool):
            raise PipelineError(f"{name} must be True or False, got {describe(value)}")
    if keep_layers is not None and (isinstance(keep_layers, bool) or not isinstance(keep_layers, int)
                                    or keep_layers < 1):
        raise PipelineError(f"keep_layers must be a layer count >= 1, got {describe(keep_layers)}")


def _check_dump_dir(dump_dir: str | os.PathLike | None, output: Path) -> IO[bytes] | None:
    """The dump directory made ready (clear_previous_dump): its marker, locked for this compile; None without."""
    if dump_dir is None:
        return None
    try:
        dumps = Path(dump_dir).resolve()
        if dumps.exists() and not dumps.is_dir():
            raise PipelineError(f"--dump-dir '{dump_dir}' exists and is not a directory")
        if dumps == output or output in dumps.parents:
            raise PipelineError(f"--dump-dir '{dump_dir}' is inside the output directory, which the compile "
                                "replaces; write the dumps elsewhere")
        dumps.mkdir(parents=True, exist_ok=True)  # now, so that an unwritable place fails before the work
        return clear_previous_dump(dumps)
    except (OSError, RuntimeError) as exc:  # RuntimeError: a symlink loop (Path.resolve)
        raise PipelineError(f"cannot use --dump-dir '{dump_dir}': {getattr(exc, 'strerror', None) or exc}") from None


def _compile_draft(spec, target_model: str, stage: Path, target_vocab: int, k: int,
                   report: CompileReport, requantize: bool = False) -> dict[str, Any]:
    """Compile the draft into stage/draft (modes that have a model), with its k-step graph; → the manifest's
    "speculative" entry. A self draft of a GGUF target reads the file as the target did (`requantize`)."""
    entry: dict[str, Any] = {"mode": spec.mode, "draft": None, "description": spec.describe(), "k": k}
    if not spec.compiled:
        return entry
    status(f"compiling the draft ({spec.describe()})")
    start = time.perf_counter()
    if spec.mode == "model":
        draft_report = compile_model(spec.model, stage / DRAFT_DIR)
    elif spec.mode == "self-int4":
        draft_report = compile_model(target_model, stage / DRAFT_DIR, passes=SELF_INT4_PASSES, requantize=requantize)
    else:
        draft_report = compile_model(target_model, stage / DRAFT_DIR, keep_layers=spec.layers, requantize=requantize)
    from fxllm.runtime.manifest import load_manifest

    draft = load_manifest(draft_report.output, verify=False)
    check_same_vocab(target_vocab, draft.spec.vocab_size, spec.describe())
    _add_unrolled_draft(draft, k, report)
    report.seconds["draft"] = time.perf_counter() - start
    entry["draft"] = DRAFT_DIR
    return entry


def _add_unrolled_draft(draft, k: int, report: CompileReport) -> None:
    """Write the draft's k steps as one graph next to its one-step model (compiler/targets/unrolled_draft.py) and
    record it in the draft's manifest; a draft graph it cannot unroll keeps one-step proposals (a report note)."""
    from fxllm.compiler.targets.unrolled_draft import write_unrolled_draft

    try:
        path = write_unrolled_draft(draft.model_file, draft.io, draft.spec, k)
    except UnsupportedModelError as exc:
        report.notes.append(f"no unrolled draft graph ({exc}); the draft proposes one token per call")
        return
    data = {key: value for key, value in draft.data.items() if key not in ("kind", "format_version", "files")}
    write_manifest(draft.directory, {**data, "unrolled_draft": {"model_file": path.name, "k": k}})


def _save_tokenizer(tokenizer: Any, directory: Path, source: ModelSource) -> None:
    """Save the source's tokenizer into the artifact and read it back as the runtime will, refusing in one line one
    that does not survive the round trip: transformers loads a tokenizer.json giving two tokens one id, but saves
    the vocabulary by id, dropping one of them, and its merges then name a token that no longer exists (the compile
    succeeded and every load of the artifact failed)."""
    from fxllm.runtime.tokenizer import load_tokenizer as load_saved_tokenizer

    tokenizer.save_pretrained(directory)
    try:
        load_saved_tokenizer(directory)
    except ArtifactError as exc:
        reason = " ".join(str(exc.__cause__ or exc).replace(str(directory), "the artifact's tokenizer").split())
        hint = ": does its vocabulary give two tokens one id?" if "out of vocabulary" in reason else ""
        raise ModelSourceError(f"the tokenizer of '{tokenizer_origin(source)}' does not load again once saved into "
                               f"the artifact ({reason}){hint}") from exc


def _tokenizer_beyond_vocabulary(tokenizer, torch_model) -> str | None:
    """A warning when the tokenizer's ids (added tokens counted) reach past the model's embedding rows: a text that
    tokenizes to one of them is refused at run time (transformers would index past the table). A vocabulary larger
    than the tokenizer (rows padded to a multiple of 64, say) is common and fine."""
    embedding = torch_model.get_input_embeddings()
    rows = getattr(embedding, "num_embeddings", None)
    vocabulary = tokenizer.get_vocab()
    size = max(vocabulary.values(), default=-1) + 1
    if rows is None or size <= rows:
        return None
    return (f"the tokenizer's ids reach {size - 1:,}, past the model's vocabulary of {rows:,}: a text that tokenizes "
            f"to an id of {rows:,} or more will be refused; is this the model's own tokenizer?")


def _audit_for_tensorrt(model_path: Path) -> list[str]:
    """Fail on any audit finding; → warnings (also printed) for the forms the audit passes but TensorRT was never
    seen to run."""
    from fxllm.compiler.targets.tensorrt_audit import audit_model, format_findings, read_graph, unverified_forms

    graph = read_graph(model_path)
    findings = audit_model(graph)
    if findings:
        raise UnsupportedModelError(format_findings(findings).replace("\n", "; "))
    warnings = [f"unverified for TensorRT: {note}" for note in unverified_forms(graph)]
    for warning in warnings:
        print(f"fxllm: warning: {warning}", file=sys.stderr)
    return warnings


def _try_engine_build(report: CompileReport) -> None:
    """Build engine.plan when TensorRT and a GPU are here; otherwise keep the audited ONNX and say what to do."""
    from fxllm.compiler.targets.tensorrt_build import TensorRTUnavailable, build_engine

    try:
        start = time.perf_counter()
        build_engine(report.output)
        report.seconds["engine"] = time.perf_counter() - start
    except TensorRTUnavailable as exc:
        report.notes.append(f"no TensorRT engine built: {exc}; the ONNX passed the TensorRT audit")
