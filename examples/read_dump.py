"""Summarize a `fxllm compile --dump-dir` directory: per pass, the ops it added or removed and the drift it caused.

usage: python examples/read_dump.py DUMP_DIR [THRESHOLD]
  THRESHOLD  flag passes whose max |Δlogit| against the captured model exceeds this (default 1e-4)

Exit status 1 when a pass is flagged, so this can gate a script.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    directory = Path(argv[1])
    threshold = float(argv[2]) if len(argv) > 2 else 1e-4
    summary = directory / "summary.txt"
    if not summary.is_file():
        print(f"{directory} has no summary.txt; is it a --dump-dir of a finished compile?", file=sys.stderr)
        return 2
    print(summary.read_text())

    flagged = []
    for report_path in sorted(directory.glob("[0-9][0-9]_*.report.json")):
        report = json.loads(report_path.read_text())
        stem = report_path.name.removesuffix(".report.json")  # e.g. 02_kv-cache
        drift = report["drift_vs_captured"]
        nodes = report["nodes"]
        print(f"{stem}  options={report['options'] or {}}  {report['seconds']:.3f} s  "
              f"nodes {nodes['before']}→{nodes['after']}")
        # ops.txt rows: "before after Δ op"; the Δ column is blank where the count did not change.
        rows = (directory / f"{stem}.ops.txt").read_text().splitlines()[1:]
        for row in rows:
            before, after, *rest = row.split()
            if len(rest) == 2:
                print(f"    {rest[0]:>6}  {rest[1]}  ({before} → {after})")
        status = "FLAG" if drift["max_abs_logit"] > threshold else "ok"
        print(f"    drift: max|Δlogit| {drift['max_abs_logit']:.3e}  mean KL {drift['mean_kl']:.2e}  "
              f"greedy {drift['greedy_agreement']:.1%}  [{status}]")
        if status == "FLAG":
            flagged.append(report["pass"])

    if flagged:
        print(f"\npasses over max|Δlogit| {threshold:g}: {', '.join(flagged)}")
        return 1
    print(f"\nno pass exceeds max|Δlogit| {threshold:g}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
