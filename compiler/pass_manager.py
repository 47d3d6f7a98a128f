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
from fxllm.errors import FxllmError, PipelineError


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


def run_pipeline(program: Program, steps: list[PipelineStep], dump_dir: str | None = None) -> tuple[Program, list]:
    sample = drift_sample(program.spec.vocab_size)
    lint(program)
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
        previous = logits
        if step.info.exact(step.options) and step_drift.greedy_agreement < 1.0:
            raise PassFailure(f"pass '{step.name}' should be exact but changed {1 - step_drift.greedy_agreement:.1%} "
                              f"of greedy tokens on the drift sample (max |Δlogit| {step_drift.max_abs_logit:.2e})")
        record = PassRecord(index, step.name, step.options, seconds, nodes_before, len(program.graph.nodes), drift,
                            program.diagnostics or None)
        records.append(record)
        if dumps:
            dumps.write_pass(record, before_text, before_ops, program)
    if dumps:
        dumps.write_summary(records)
    return program, records
