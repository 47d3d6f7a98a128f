"""Pass-by-pass dumps: the readable graph before/after each pass, op histograms, time and drift, and a summary."""

from __future__ import annotations

import json
import os
import re
from collections import Counter
from pathlib import Path
from typing import IO

from fxllm.compiler.program import Program
from fxllm.errors import PipelineError


def op_name(node) -> str:
    if node.op != "call_function":
        return node.op
    return str(node.target) if hasattr(node.target, "_schema") else getattr(node.target, "__name__", str(node.target))


def op_histogram(program: Program) -> Counter:
    return Counter(op_name(n) for n in program.graph.nodes if n.op in ("call_function", "placeholder", "get_attr"))


def signature_text(program: Program) -> str:
    rows = [f"  in  {s.name}: {s.dtype}[{', '.join(map(str, s.dims))}]" for s in program.inputs]
    rows += [f"  out {s.name}: {s.dtype}[{', '.join(map(str, s.dims))}]" for s in program.outputs]
    return "\n".join(rows)


class DumpWriter:
    def __init__(self, directory: str):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        mark_as_dump(self.directory)

    def render(self, program: Program) -> str:
        code = program.graph_module.print_readable(
            print_output=False, include_stride=False, include_device=False, colored=False
        )
        facts = ", ".join(sorted(program.facts)) or "-"
        return f"# facts: {facts}\n# signature:\n{signature_text(program)}\n\n{code}"

    def write_captured(self, program: Program) -> None:
        (self.directory / "00_captured.txt").write_text(self.render(program))
        (self.directory / "00_captured.ops.txt").write_text(_histogram_text(op_histogram(program), None))

    def write_pass(self, record, before_text: str, before_ops: Counter, program: Program) -> None:
        stem = f"{record.index:02d}_{record.name}"
        (self.directory / f"{stem}.before.txt").write_text(before_text)
        (self.directory / f"{stem}.after.txt").write_text(self.render(program))
        (self.directory / f"{stem}.ops.txt").write_text(_histogram_text(op_histogram(program), before_ops))
        drift = record.drift
        report = {
            "pass": record.name,
            "options": record.options,
            "seconds": round(record.seconds, 4),
            "nodes": {"before": record.nodes_before, "after": record.nodes_after},
            "drift_vs_captured": drift.to_dict(),
        }
        if record.diagnostics:
            report["diagnostics"] = record.diagnostics
            layers = record.diagnostics.get("layers")
            if layers:
                (self.directory / f"{stem}.layers.txt").write_text(layer_table(layers))
        (self.directory / f"{stem}.report.json").write_text(json.dumps(report, indent=2) + "\n")

    def write_summary(self, records: list) -> None:
        header = f"{'#':>2}  {'pass':<16} {'time s':>8} {'nodes':>13} {'max|Δlogit|':>12} {'mean KL':>10} {'greedy':>7}"
        lines = ["fxllm pass summary (drift is against the captured model on a fixed 2x16-token sample)", "", header,
                 "-" * len(header)]
        for r in records:
            d = r.drift
            lines.append(
                f"{r.index:>2}  {r.name:<16} {r.seconds:>8.3f} {r.nodes_before:>6}→{r.nodes_after:<6} "
                f"{d.max_abs_logit:>12.3e} {d.mean_kl:>10.2e} {d.greedy_agreement:>7.1%}"
            )
        (self.directory / "summary.txt").write_text("\n".join(lines) + "\n")
        (self.directory / "summary.json").write_text(
            json.dumps([{"pass": r.name, "options": r.options, "seconds": r.seconds, "drift": r.drift.to_dict()}
                        for r in records], indent=2) + "\n"
        )


DUMP_FILE = re.compile(r"^(\d{2,}_[\w.-]+|summary)\.(txt|json)$")  # what DumpWriter writes, and nothing else
DUMP_MARKER = ".fxllm-dump"  # in every dump directory: what tells a previous dump from the user's look-alike files


def mark_as_dump(directory: Path) -> None:
    """Write the marker unless it is there; never through a symlink (a dangling one would create its target)."""
    try:
        descriptor = os.open(directory / DUMP_MARKER, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o666)
    except FileExistsError:
        return
    with os.fdopen(descriptor, "w") as marker:
        marker.write("fxllm compile --dump-dir writes here; a dump into this directory replaces its files\n")


def clear_previous_dump(directory: Path) -> IO[bytes]:
    """Make `directory` ready for a new dump: the files of a previous dump (it holds DUMP_MARKER) go; a directory
    holding anything else, or files named like a dump's without the marker (the user's summary.txt), or a marker
    that is not a plain file, is refused (PipelineError), so a dump never overwrites or mixes with files of the
    user's. Returns the marker, open and locked (flock) for this compile: another compile into the same directory
    is refused while it is held (two at once left one's summary beside the other's pass files); closing it, or the
    process ending, lets it go."""
    marker = directory / DUMP_MARKER
    if marker.is_symlink() or (marker.exists() and not marker.is_file()):
        raise PipelineError(f"--dump-dir '{directory}' holds a {DUMP_MARKER} that is not a plain file; name a new or "
                            "empty directory, or a previous dump's")
    entries = sorted(entry for entry in directory.iterdir() if entry.name != DUMP_MARKER)
    foreign = [entry.name for entry in entries if not (DUMP_FILE.match(entry.name) and entry.is_file())]
    if foreign:
        raise PipelineError(f"--dump-dir '{directory}' holds files that are not an fxllm dump (e.g. '{foreign[0]}'); "
                            "name a new or empty directory, or a previous dump's")
    if entries and not marker.is_file():
        raise PipelineError(f"--dump-dir '{directory}' holds files named like a dump's (e.g. '{entries[0].name}') "
                            f"but not the {DUMP_MARKER} file an fxllm dump leaves; name a new or empty directory, or "
                            "a previous dump's")
    lock = _locked_marker(directory)
    try:
        for entry in entries:
            entry.unlink()
    except BaseException:
        lock.close()
        raise
    return lock


def _locked_marker(directory: Path) -> IO[bytes]:
    import fcntl

    mark_as_dump(directory)
    marker = os.fdopen(os.open(directory / DUMP_MARKER, os.O_RDONLY | os.O_NOFOLLOW), "rb")
    try:
        fcntl.flock(marker.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        marker.close()
        raise PipelineError(f"--dump-dir '{directory}' is being written by another compile; wait for it to finish, "
                            "or name another directory") from None
    return marker


def layer_table(layers: list[dict]) -> str:
    """Per-layer quantization errors, worst output error first, so the layer that hurts most is on top."""
    ranked = sorted(layers, key=lambda r: -(r["output_error"] if r["output_error"] is not None else r["weight_error"]))
    header = f"{'layer':<18} {'weight':<46} {'shape':>12} {'bits':>4} {'group':>5} {'weight err':>10} {'output err':>10} {'(rtn)':>8}  note"
    rows = [
        "relative errors ‖W−Ŵ‖/‖W‖ and ‖xWᵀ−xŴᵀ‖/‖xWᵀ‖ on the calibration inputs each layer receives "
        "(after earlier layers were quantized), and round-to-nearest's output error on the same inputs; worst first",
        "", header, "-" * len(header)]
    for r in ranked:
        out = "-" if r["output_error"] is None else f"{r['output_error']:.4f}"
        rtn = "-" if r.get("rtn_output_error") is None else f"{r['rtn_output_error']:.4f}"
        shape = "x".join(map(str, r["shape"]))
        rows.append(f"{r['layer']:<18} {r['weight'].removeprefix('model.'):<46} {shape:>12} {r['bits']:>4} {r['group_size']:>5} "
                    f"{r['weight_error']:>10.4f} {out:>10} {rtn:>8}  {r['note']}")
    return "\n".join(rows) + "\n"


def _histogram_text(after: Counter, before: Counter | None) -> str:
    names = sorted(set(after) | set(before or {}), key=lambda n: (-after.get(n, 0), n))
    if before is None:
        return "\n".join(f"{after[n]:>6}  {n}" for n in names) + "\n"
    rows = [f"{'before':>6} {'after':>6} {'Δ':>6}  op"]
    for n in names:
        b, a = before.get(n, 0), after.get(n, 0)
        rows.append(f"{b:>6} {a:>6} {a - b:>+6}  {n}" if a != b else f"{b:>6} {a:>6} {'':>6}  {n}")
    return "\n".join(rows) + "\n"
