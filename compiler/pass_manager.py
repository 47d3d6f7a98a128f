"""Run a validated pipeline: each pass, then lint, drift against the captured model, and optional dumps."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from fxllm.compiler.drift import Drift, Logits, compare_logits, drift_sample
from fxllm.compiler.dump import DumpWriter, op_histogram
from fxllm.compiler.interface import run_sequence
from fxllm.compiler.lint import LintError, lint
from fxllm.compiler.pipeline import PipelineStep
from fxllm.compiler.program import AppliedPass, Program
from fxllm.progress import progress
from fxllm.errors import FxllmError, PipelineError, UnsupportedModelError


@dataclass(frozen=True)
class PassRecord:
    index: int
    name: str
    options: dict
    seconds: float
    nodes_before: int
    nodes_after: int
    drift: Drift
    diagnostics: dict | None = None  # what the pass reported about itself (e.g. quantize's per-layer errors)


class PassFailure(FxllmError):
    """A pass raised or produced a graph that does not lint; names the pass."""


ORIGIN = "fxllm_origin"  # key in node.meta["custom"] (which torch.export carries over): the creating pass


def origin_of(node: torch.fx.Node) -> str | None:
    return node.meta.get("custom", {}).get(ORIGIN)


def stamp_origin(program: Program, origin: str) -> None:
    """Record which pass created each new node, so lowering and the TensorRT audit can name it."""
    for node in program.graph.nodes:
        custom = node.meta.setdefault("custom", {})
        custom.setdefault(ORIGIN, origin)


def _lint_reason(exc: LintError) -> str:
    """A captured graph's lint failure in one line; reading a tensor's values into Python (`.item()`,
    `.tolist()`: data-dependent sizes such as a per-expert token count) is named as such, with the model's line."""
    text = str(exc)
    if "_local_scalar_dense" in text or "aten.item" in text:
        source = [line.strip() for line in text.splitlines()
                  if line.strip() and not line.lstrip().startswith("File ")]
        where = next((line for line in reversed(source) if "=" in line and "(" in line and "Use tlparse" not in line),
                     "")
        return ("its code reads a tensor's values into Python (data-dependent sizes or control flow"
                + (f": `{where}`" if where else "") + "), which a compiled graph cannot")
    return " ".join(text.split())[:600]


EXACT_TOLERANCE = 1e-3  # of the logits' scale: float rounding of an exact rewrite stays orders of magnitude below


def check_exact(name: str, drift: Drift, before: Logits) -> None:
    """An exact pass keeps every greedy token of the drift sample and moves no logit by more than float rounding
    (EXACT_TOLERANCE of the largest |logit|, at least of 1): a rewrite that changed the math slightly (a value the
    model computes from the sequence length, which the cache changes) passed the greedy check on a sample of 32
    tokens and was wrong further on. Float32 rewrites of SmolLM2 move its logits (up to ~25) by ~1e-4; a tiny
    random model's (~1) by ~1e-7."""
    scale = max(1.0, float(before.values.abs().max()))
    if drift.greedy_agreement < 1.0:
        change = f"changed {1 - drift.greedy_agreement:.1%} of greedy tokens"
    elif drift.max_abs_logit > EXACT_TOLERANCE * scale:
        change = f"moved the logits by more than float rounding ({EXACT_TOLERANCE:g} of their scale {scale:.3g})"
    else:
        return
    raise PassFailure(f"pass '{name}' should be exact but {change} on the drift sample (max |Δlogit| "
                      f"{drift.max_abs_logit:.2e}); the model may compute something the rewrite does not carry over, "
                      "e.g. a value from the sequence length instead of position_ids")


def run_pipeline(program: Program, steps: list[PipelineStep], dump_dir: str | None = None) -> tuple[Program, list]:
    sample = drift_sample(program.spec.vocab_size)
    try:
        lint(program)
    except LintError as exc:  # before any pass: the captured model itself, not a pass, is what cannot be compiled
        raise UnsupportedModelError(f"the captured graph of {program.spec.architecture} cannot be compiled: "
                                    f"{_lint_reason(exc)}") from exc
    stamp_origin(program, "capture")
    reference = Logits.of(run_sequence(program, sample))
    if not torch.isfinite(reference.values).all():
        raise PipelineError("the model's own logits are not finite (NaN or inf) on the drift sample, before any "
                            "pass: its weights hold NaN or inf, or overflow in float32; nothing was written")
    previous = reference
    dumps = DumpWriter(dump_dir) if dump_dir else None
    if dumps:
        dumps.write_captured(program)
    records: list[PassRecord] = []
    for index, step in enumerate(progress(steps, desc="passes", unit="pass"), start=1):
        before_text = dumps.render(program) if dumps else None
        before_ops = op_histogram(program) if dumps else None
        nodes_before = len(program.graph.nodes)
        start = time.perf_counter()
        try:
            program.diagnostics = {}
            program = step.info.run(program, step.options)
            program.graph_module.recompile()
            lint(program)
        except FxllmError:
            raise
        except LintError as exc:
            raise PassFailure(f"pass '{step.name}' produced an invalid graph: {exc}") from exc
        except Exception as exc:  # a bug in the pass: name it
            raise PassFailure(f"pass '{step.name}' failed: {type(exc).__name__}: {exc}") from exc
        seconds = time.perf_counter() - start
        stamp_origin(program, step.name)
        program.facts |= step.info.provides
        program.applied.append(AppliedPass(step.name, step.options))
        with torch.no_grad():
            logits = Logits.of(run_sequence(program, sample))
        if not torch.isfinite(logits.values).all():
            raise PassFailure(f"pass '{step.name}' made the logits non-finite (NaN or inf) on the drift sample")
        drift = compare_logits(reference, logits)
        step_drift = compare_logits(previous, logits)  # this pass alone, not what earlier passes changed
        if step.info.exact(step.options):
            check_exact(step.name, step_drift, previous)
        previous = logits
        record = PassRecord(index, step.name, step.options, seconds, nodes_before, len(program.graph.nodes), drift,
                            program.diagnostics or None)
        records.append(record)
        if dumps:
            dumps.write_pass(record, before_text, before_ops, program)
    if dumps:
        dumps.write_summary(records)
    return program, records
