"""Speculative-decoding benchmark: every draft mode against plain decoding of the same fp32 target, in one run.

Measures greedy decoding at batch 1 with a fixed number of intra-op threads (default 2) and exactly --new-tokens new
tokens per prompt (EOS does not stop any row). The rows are

    no speculation            the fp32 target alone (the self-int4 artifact loaded with speculative=False)
    self-int4 k=K             draft = the target quantized int4-rtn group 32; one artifact, k set per row at load
    self-int4 k=4 float draft the same draft with float activations (the default for a quantized draft is int8
                              activations, ONNX Runtime's fast int4 kernels; the target is fp32 either way)
    self-int4 k=4 unrolled    the float draft proposing its 4 tokens in one call of its unrolled graph
    self-layers:N k=4         draft = the target's first N layers + final norm + lm_head (early exit)
    ngram k=4                 prompt lookup: proposals copied from earlier n-gram matches, no draft model

and for each: tokens/s (generated tokens over the wall time of generate, prefill included, summed over the
prompts), the speedup over "no speculation" measured in this same run, the acceptance rate (accepted / proposed
draft tokens), tokens emitted per target (verification) call, the share of the wall time spent in the draft and in
verification, and whether the greedy tokens are identical to "no speculation" for every prompt (they should be:
greedy verification keeps exactly the target's argmax).

Two tables: natural prompts (--prompts N short instructions / text beginnings), then an "editing" prompt that
asks the model to repeat a ~150-token paragraph, so that prompt lookup (ngram) finds its matches. A third table runs
the editing workload at --concurrency N (default 8) on a paged artifact of the same fp32 model: N different
paragraphs to repeat, submitted in one call, plain paged decoding (every running request decoded once per call)
against ngram k=4 (prompt lookup switched on at load time; every running request's drafts verified in one call),
with the speedup and its decode-phase share (prefill, identical in both rows, excluded), the acceptance, the mean
decode batch and whether the greedy tokens are identical; the machine's load average is printed with it. Target of
the engine-core issue: ngram at concurrency N >= 1.5x plain paged at concurrency N. Prompts and modes
are interleaved (for each prompt, every row in turn) so load from other processes hits all rows alike; with
--repeats R each (row, prompt) keeps its fastest of R runs. After each table come the per-forward costs behind
each row and the expected speedup (1 - a^(k+1)) / ((1 - a) (k c + 1)), with c the draft's cost per proposed token
over the target's per decoded token and a the per-token acceptance probability (solved from the measured tokens per
target call: accepted/proposed is lower, since proposals after a rejection are never examined); at the end the
target of the issue: self-int4 at its best k >= 1.8x over no speculation with identical greedy output on the
natural prompts, reported as met or missed.

    .venv/bin/python benchmarks/speculative.py                      # SmolLM2-135M fp32, 64 tokens, 4 prompts
    .venv/bin/python benchmarks/speculative.py --ks 2,4,6,8 --layers 12 --json spec.json
    .venv/bin/python benchmarks/speculative.py --quick              # 2 prompts, 24 tokens, k=4 only
    .venv/bin/python benchmarks/speculative.py --tables concurrency --repeats 3   # the concurrency table alone

Artifacts (fp32 target + draft) are compiled on the first run into ~/.cache/fxllm/bench/<model>--spec-<mode>
(self-int4, self-layers-N, ngram) and reused while their recorded draft matches; --recompile rebuilds them. The
concurrency table's paged artifact is benchmarks/paged.py's (~/.cache/fxllm/bench/<model>--paged, blocks of 16),
or --paged-artifact.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from decode import CACHE_DIR, ensure_artifact as ensure_compiled, environment, first_difference, script_main
from paged import PAGED_PASSES

import fxllm
from fxllm.compiler.draft import parse_draft
from fxllm.runtime.contract import MAX_SPEC_K
from fxllm.compiler.sources import resolve_source
from fxllm.errors import ArtifactError
from fxllm.runtime.manifest import load_manifest

NATURAL_PROMPTS = [
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg, a goldsmith "
    "from Mainz,",
    "Explain to a ten-year-old how plants make their own food from sunlight:\n",
    "Here is a Python function that checks whether a number is prime:\n\ndef is_prime(n):",
    "Once upon a time, in a small village at the edge of a great forest, there lived",
    "The three most important things to remember when you start learning a new language are",
    "Q: What causes the seasons on Earth?\nA:",
    "Write a short, friendly email to a colleague asking to move tomorrow's meeting to Friday.\n\n",
    "The main differences between a virus and a bacterium are",
]
PARAGRAPH = (
    "The lighthouse at the northern end of the island was built in 1852 from granite quarried on the mainland and "
    "carried across the strait by barge. For more than a century its keepers climbed the ninety-seven steps every "
    "evening to light the lamp, wind the clockwork that turned the lens, and record the weather in a leather-bound "
    "log. In 1961 the light was electrified and the last keeper left the island, but the logbooks survived in the "
    "village library, where visitors can still read about storms, shipwrecks, and the long quiet winters when no "
    "boat could make the crossing. Today a small museum in the old keeper's cottage shows the original lens, a "
    "brass telescope, and a map of every wreck recorded on the reefs."
)
# More paragraphs for the editing workload at concurrency: one different text per concurrent request.
MORE_PARAGRAPHS = [
    "The village bakery opens at five in the morning, long before the first bus leaves for the city. The baker "
    "lights the wood oven at three, shapes the rye loaves while it heats, and sets aside a tray of small rolls "
    "for the children who stop by on their way to school. On Saturdays the queue reaches the church steps, and "
    "whoever arrives after eight finds only crumbs, a chalkboard apology, and the smell of bread in the empty shop.",
    "A glacier moves so slowly that it seems to stand still, yet it carries boulders the size of houses for "
    "hundreds of kilometres. As it creeps downhill the ice grinds the rock beneath it into fine powder, which "
    "turns the meltwater rivers a milky green. When the climate warms the glacier retreats, leaving behind long "
    "ridges of gravel, polished stone, and lakes that fill the hollows it once scraped out of the valley floor.",
    "The old railway station was closed in 1968, when the branch line was replaced by a bus that ran twice a "
    "day. For thirty years the building stood empty, its platform covered in moss and its clock stopped at "
    "twenty past four. Then a group of volunteers bought it for a single pound, repaired the roof, restored the "
    "ticket office, and opened a cafe where walkers now rest before climbing the hill to the ruined castle.",
    "Honeybees communicate the location of food with a dance. A forager returning to the hive walks in a figure "
    "of eight, waggling her body during the straight run in the middle. The angle of that run relative to "
    "vertical shows the direction of the flowers relative to the sun, and the length of the waggle tells her "
    "sisters how far they must fly. Within minutes dozens of bees leave the hive on exactly the right heading.",
    "The town council met on Tuesday evening to discuss the new footbridge over the river. Engineers presented "
    "three designs: a steel arch, a timber truss, and a suspension bridge hung from two stone towers. Residents "
    "worried about the cost, the noise of construction, and whether the bridge would spoil the view of the "
    "harbour. After two hours of debate the council chose the timber truss and promised a public vote in spring.",
    "A good map tells you what its makers thought was important. Early sea charts show every rock and shoal "
    "along the coast but leave the interior blank, because sailors cared about the shore and little else. Road "
    "atlases of the last century mark petrol stations and motels, and the maps on our phones show cafes and "
    "shops, quietly recording where we walk so that the next version can show us even more of what we want.",
    "In the workshop behind the museum a conservator spends months on a single painting. She removes the "
    "yellowed varnish with cotton swabs and solvent, a square centimetre at a time, then photographs the surface "
    "under ultraviolet light to find earlier repairs. Where paint has flaked away she fills the gaps with a "
    "reversible putty and retouches only the losses, so that a future conservator can undo everything she did.",
]
EDITING_PARAGRAPHS = [PARAGRAPH, *MORE_PARAGRAPHS]


def editing_prompt(paragraph: str) -> str:
    return f"Repeat the following text exactly:\n{paragraph}\n\nRepeated text:\n"


EDITING_PROMPT = editing_prompt(PARAGRAPH)
PLAIN_PAGED = "plain paged"
TARGET_CONCURRENT_SPEEDUP = 1.5
BASELINE = "no speculation"
TARGET_SPEEDUP = 1.8
TARGET_MODE = "self-int4"


@dataclass(frozen=True)
class Row:
    """One table row: an artifact, loaded with or without speculation, with its k."""
    name: str
    mode: str | None  # None: no speculation
    artifact: Path
    k: int | None = None
    unrolled: bool = False  # the draft's k proposals in one call (Engine.load's unrolled_draft)
    int8_activations: bool | None = None  # None: the default (int8 for a quantized draft)


@dataclass
class Tally:
    """One row's measurements over one prompt set."""
    wall_s: float = 0.0
    tokens: int = 0
    proposed: int = 0
    accepted: int = 0
    target_calls: int = 0
    draft_s: float = 0.0
    verify_s: float = 0.0
    prefill_ms: list[float] = field(default_factory=list)  # no speculation: the engine's own timings
    decode_ms_per_token: list[float] = field(default_factory=list)
    token_ids: list[list[int]] = field(default_factory=list)  # per prompt

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s else 0.0

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted / self.proposed if self.proposed else None

    @property
    def tokens_per_target_call(self) -> float | None:
        return (self.accepted + self.target_calls) / self.target_calls if self.target_calls else None


# --- arguments ---------------------------------------------------------------------------------------------------

def parse_ks(text: str) -> list[int]:
    try:
        ks = sorted({int(item) for item in text.split(",") if item.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma list of k values, got '{text}'") from None
    if not ks or not all(1 <= k <= MAX_SPEC_K for k in ks):
        raise argparse.ArgumentTypeError(f"k values must be between 1 and {MAX_SPEC_K}, got '{text}'")
    return ks


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m", help="HF directory, .gguf file or 'smollm2-135m'")
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens generated per prompt (EOS ignored)")
    parser.add_argument("--prompts", type=int, default=4, help=f"natural prompts, 1-{len(NATURAL_PROMPTS)}")
    parser.add_argument("--layers", type=int, default=8, help="layers kept by the self-layers draft")
    parser.add_argument("--ks", type=parse_ks, default=[2, 4, 6], metavar="K[,K...]", help="k values of self-int4")
    parser.add_argument("--threads", type=int, default=2, help="intra-op threads of every engine (draft included)")
    parser.add_argument("--repeats", type=int, default=1, help="runs per (row, prompt); the fastest counts")
    parser.add_argument("--recompile", action="store_true", help="rebuild the cached artifacts")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--quick", action="store_true", help="smoke run: at most 2 prompts and 24 tokens, k=4")
    parser.add_argument("--tables", type=parse_tables, default=TABLES, metavar="T[,T...]",
                        help=f"which tables to run, of {','.join(TABLES)}")
    parser.add_argument("--concurrency", type=int, default=8,
                        help=f"concurrent requests of the concurrency table, 1-{len(EDITING_PARAGRAPHS)}")
    parser.add_argument("--paged-artifact", type=Path, help="the paged artifact of the concurrency table")
    return parser


TABLES = ("natural", "editing", "concurrency")


def parse_tables(text: str) -> tuple[str, ...]:
    tables = tuple(item.strip() for item in text.split(",") if item.strip())
    if not tables or not set(tables) <= set(TABLES):
        raise argparse.ArgumentTypeError(f"tables are {', '.join(TABLES)}; got '{text}'")
    return tables


# --- artifacts ---------------------------------------------------------------------------------------------------

def artifact_directory(model_name: str, mode: str) -> Path:
    return CACHE_DIR / f"{model_name}--spec-{mode.replace(':', '-')}"


def ensure_artifact(model: str, model_name: str, draft: str, recompile: bool) -> Path:
    """The artifact of `model` with `draft` under CACHE_DIR, compiled unless a matching one is cached."""
    directory = artifact_directory(model_name, draft)
    wanted = parse_draft(draft, 4).describe()
    if not recompile:
        try:
            manifest = load_manifest(directory, verify=False).data  # fxllm.load checksums the files
        except ArtifactError:
            manifest = None
        if manifest is not None:
            recorded = (manifest.get("speculative") or {}).get("description")
            unrolled = draft == "ngram" or _has_unrolled_draft(directory)
            if recorded == wanted and manifest["source"]["name"] == model_name and unrolled:
                print(f"using cached artifact {directory} (--recompile to rebuild it)")
                return directory
            print(f"cached artifact {directory} holds draft {recorded!r} of '{manifest['source']['name']}'"
                  f"{'' if unrolled else ' without an unrolled draft graph'}; recompiling")
    start = time.perf_counter()
    fxllm.compile(model, directory, draft=draft, spec_k=4)
    print(f"compiled {model} --draft {draft} → {directory} in {time.perf_counter() - start:.1f} s", flush=True)
    return directory


def _has_unrolled_draft(directory: Path) -> bool:
    try:
        return load_manifest(directory / "draft", verify=False).unrolled_draft is not None
    except ArtifactError:
        return False


# --- measuring ---------------------------------------------------------------------------------------------------

def load_engines(rows: list[Row], threads: int) -> dict[str, Any]:
    engines = {}
    for row in rows:
        engine = fxllm.load(row.artifact, threads=threads, speculative=row.mode is not None, spec_k=row.k,
                            unrolled_draft=row.unrolled, int8_activations=row.int8_activations)
        engine.eos_token_ids = set()  # exactly new_tokens tokens per prompt (the draft's EOS never stops anything)
        if engine.speculator is None and row.mode is not None:
            raise SystemExit(f"speculative.py: {row.artifact} loaded without a draft; pass --recompile")
        engines[row.name] = engine
    return engines


def measure_one(engine: Any, ids: list[int], new_tokens: int) -> tuple[float, list[int], Any, dict]:
    """Wall time, tokens, the run's speculative counters (None without a draft) and the request's timings."""
    before = engine.stats()
    start = time.perf_counter()
    result = engine.generate_ids([ids], max_new_tokens=new_tokens)[0]
    wall = time.perf_counter() - start
    return wall, list(result.token_ids), engine.stats().since(before).speculative, dict(result.timings)


def measure_set(rows: list[Row], engines: dict[str, Any], prompts: list[list[int]], new_tokens: int,
                repeats: int) -> dict[str, Tally]:
    """Every row on every prompt, interleaved; per (row, prompt) the fastest of `repeats` runs counts."""
    tallies = {row.name: Tally() for row in rows}
    for number, ids in enumerate(prompts, 1):
        best: dict[str, tuple] = {}
        for _ in range(repeats):
            for row in rows:
                run = measure_one(engines[row.name], ids, new_tokens)
                if len(run[1]) != new_tokens:
                    raise SystemExit(f"speculative.py: {row.name} generated {len(run[1])} tokens, not {new_tokens}")
                if row.name not in best or run[0] < best[row.name][0]:
                    best[row.name] = run
        for row in rows:
            wall, tokens, metrics, timings = best[row.name]
            tally = tallies[row.name]
            tally.wall_s += wall
            tally.tokens += len(tokens)
            tally.token_ids.append(tokens)
            if row.mode is None:
                tally.prefill_ms.append(timings.get("prefill_ms", 0.0))
                tally.decode_ms_per_token.append(timings.get("decode_ms_per_token", 0.0))
            else:
                tally.proposed += metrics.proposed
                tally.accepted += metrics.accepted
                tally.target_calls += metrics.target_calls
                tally.draft_s += metrics.draft_time_s
                tally.verify_s += metrics.verify_time_s
        summary = "  ".join(f"{row.name} {len(best[row.name][1]) / best[row.name][0]:.1f}" for row in rows)
        print(f"  prompt {number}/{len(prompts)} ({len(ids)} tokens), tokens/s: {summary}", flush=True)
    return tallies


def warm_up(rows: list[Row], engines: dict[str, Any], ids: list[int]) -> None:
    for row in rows:
        engines[row.name].generate_ids([ids], max_new_tokens=8)


# --- the editing workload at concurrency, on the paged cache ---------------------------------------------------

@dataclass
class ConcurrentRun:
    """One row's fastest run: every prompt submitted in one generate call."""
    wall_s: float
    tokens: int
    decode_s: float  # the engine's decode calls (verification included); prefill calls excluded
    decode_tokens: int
    mean_decode_batch: float
    speculative: Any  # SpeculativeMetrics of the run, None for plain paged
    token_ids: list[list[int]]

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s else 0.0


def measure_concurrent(engines: dict[str, Any], prompts: list[list[int]], new_tokens: int,
                       repeats: int) -> dict[str, ConcurrentRun]:
    """Each engine runs all prompts at once, in turns, `repeats` times; per engine the fastest run counts."""
    best: dict[str, ConcurrentRun] = {}
    for _ in range(repeats):
        for name, engine in engines.items():
            before = engine.stats()
            start = time.perf_counter()
            results = engine.generate_ids(prompts, max_new_tokens=new_tokens)
            wall = time.perf_counter() - start
            stats = engine.stats().since(before)
            tokens = [list(r.token_ids) for r in results]
            if any(len(ids) != new_tokens for ids in tokens):
                raise SystemExit(f"speculative.py: {name} generated fewer than {new_tokens} tokens for a prompt")
            decode_tokens = sum(map(len, tokens)) - len(prompts)  # each prompt's first token comes from its prefill
            run = ConcurrentRun(wall, sum(map(len, tokens)), stats.decode_seconds, decode_tokens,
                                stats.mean_decode_batch, stats.speculative, tokens)
            if name not in best or wall < best[name].wall_s:
                best[name] = run
        print("  " + "  ".join(f"{name} {run.tokens_per_s:.1f} tokens/s" for name, run in best.items()), flush=True)
    return best


def format_concurrent_table(runs: dict[str, ConcurrentRun], concurrency: int) -> str:
    baseline = runs[PLAIN_PAGED]
    header = ["mode", "concurrency", "tokens/s", "speedup", "decode tokens/s", "decode speedup", "acceptance",
              "tokens/target call", "mean decode batch", "greedy identical"]
    lines = []
    for name, run in runs.items():
        spec = run.speculative
        same = [first_difference(ids, ref) for ids, ref in zip(run.token_ids, baseline.token_ids)]
        wrong = [f"p{i + 1}@{index}" for i, index in enumerate(same) if index is not None]
        lines.append([name, str(concurrency), f"{run.tokens_per_s:.1f}",
                      f"{run.tokens_per_s / baseline.tokens_per_s:.2f}x", f"{run.decode_tokens_per_s:.1f}",
                      f"{run.decode_tokens_per_s / baseline.decode_tokens_per_s:.2f}x",
                      percent(spec.acceptance_rate) if spec else "-",
                      f"{spec.tokens_per_target_call:.2f}" if spec else "-", f"{run.mean_decode_batch:.1f}",
                      "(reference)" if spec is None else ("yes" if not wrong else f"NO ({', '.join(wrong)})")])
    return markdown_table(header, lines)


def load_average() -> str:
    try:
        return "load average " + " / ".join(f"{value:.1f}" for value in os.getloadavg()) + " (1 / 5 / 15 min)"
    except OSError:
        return "load average unknown"


def run_concurrency(args: argparse.Namespace, model_name: str) -> dict[str, Any]:
    directory = args.paged_artifact or CACHE_DIR / f"{model_name}--paged"
    if args.paged_artifact is None:
        ensure_compiled(args.model, directory, PAGED_PASSES.format(block_size=16), args.recompile)
    engines = {PLAIN_PAGED: fxllm.load(directory, threads=args.threads, speculative=False),
               "ngram k=4": fxllm.load(directory, threads=args.threads, speculative="ngram", spec_k=4)}
    for engine in engines.values():
        if not engine.paged:
            raise SystemExit(f"speculative.py: {directory} is not a paged artifact")
        engine.eos_token_ids = set()
    tokenizer = engines[PLAIN_PAGED].tokenizer
    prompts = [list(tokenizer.encode(editing_prompt(p))) for p in EDITING_PARAGRAPHS[:args.concurrency]]
    print(f"\nediting workload at concurrency {args.concurrency} on the paged artifact {directory} "
          f"({', '.join(str(len(ids)) for ids in prompts)} prompt tokens), {args.new_tokens} new tokens each; "
          f"{load_average()}", flush=True)
    for engine in engines.values():  # warm-up
        engine.generate_ids(prompts[:2], max_new_tokens=8)
    runs = measure_concurrent(engines, prompts, args.new_tokens, args.repeats)
    print(format_concurrent_table(runs, args.concurrency))
    speedup = runs["ngram k=4"].tokens_per_s / runs[PLAIN_PAGED].tokens_per_s
    verdict = "MET" if speedup >= TARGET_CONCURRENT_SPEEDUP else "MISSED"
    print(f"target: ngram at concurrency {args.concurrency} >= {TARGET_CONCURRENT_SPEEDUP}x plain paged at "
          f"concurrency {args.concurrency}: {speedup:.2f}x → {verdict}; {load_average()}")
    return {"artifact": str(directory), "concurrency": args.concurrency, "speedup": speedup,
            "rows": {name: {"wall_s": r.wall_s, "tokens": r.tokens, "tokens_per_s": r.tokens_per_s,
                            "decode_s": r.decode_s, "decode_tokens_per_s": r.decode_tokens_per_s,
                            "mean_decode_batch": r.mean_decode_batch,
                            "speculative": vars(r.speculative) if r.speculative else None, "token_ids": r.token_ids}
                     for name, r in runs.items()}}


# --- reporting ---------------------------------------------------------------------------------------------------

def greedy_verdict(tally: Tally, baseline: Tally) -> tuple[bool, str]:
    differences = [(i, first_difference(ids, ref)) for i, (ids, ref) in
                   enumerate(zip(tally.token_ids, baseline.token_ids))]
    differences = [(i, index) for i, index in differences if index is not None]
    if not differences:
        return True, f"yes ({len(tally.token_ids)}/{len(tally.token_ids)})"
    where = ", ".join(f"p{i + 1}@{index}" for i, index in differences)
    return False, f"NO ({where})"


def percent(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.0f}%"


def format_table(rows: list[Row], tallies: dict[str, Tally]) -> str:
    baseline = tallies[BASELINE]
    header = ["mode", "tokens/s", "speedup", "acceptance", "tokens/target call", "draft % wall", "verify % wall",
              "greedy identical"]
    lines = []
    for row in rows:
        t = tallies[row.name]
        speculative = row.mode is not None
        lines.append([
            row.name, f"{t.tokens_per_s:.1f}", f"{t.tokens_per_s / baseline.tokens_per_s:.2f}x",
            percent(t.acceptance_rate) if speculative else "-",
            f"{t.tokens_per_target_call:.2f}" if speculative and t.tokens_per_target_call else "-",
            percent(t.draft_s / t.wall_s) if speculative else "-",
            percent(t.verify_s / t.wall_s) if speculative else "-",
            greedy_verdict(t, baseline)[1] if speculative else "(reference)",
        ])
    return markdown_table(header, lines)


def markdown_table(header: list[str], lines: list[list[str]]) -> str:
    """A markdown table: the first column left-aligned, the others right-aligned."""
    widths = [max(len(line[i]) for line in [header, *lines]) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        padded = [cells[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(cells[1:], widths[1:])]
        return "| " + " | ".join(padded) + " |"

    rule = "|" + "|".join(["-" * (widths[0] + 2)] + ["-" * (w + 1) + ":" for w in widths[1:]]) + "|"
    return "\n".join([line(header), rule, *(line(cells) for cells in lines)])


def expected_tokens(alpha: float, k: float) -> float:
    """Expected tokens per target call when each draft token is accepted with probability alpha (i.i.d.)."""
    return k + 1 if alpha >= 1 else (1 - alpha ** (k + 1)) / (1 - alpha)


def expected_speedup(alpha: float, k: float, c: float, v: float = 1.0) -> float:
    """Leviathan et al.: tokens per call (1 - a^(k+1)) / (1 - a) over a round's cost k c + v (v = 1: verifying
    k+1 tokens costs one decode step), in units of one target decode step."""
    return expected_tokens(alpha, k) / (k * c + v)


def per_token_alpha(tokens_per_call: float, k: int) -> float:
    """The alpha whose expected tokens per call match the measured ones. accepted/proposed underestimates it: the
    proposals after a round's first rejection count as proposed but are never examined."""
    low, high = 0.0, 1.0
    for _ in range(60):
        middle = (low + high) / 2
        low, high = (middle, high) if expected_tokens(middle, k) < tokens_per_call else (low, middle)
    return (low + high) / 2


def analysis(rows: list[Row], tallies: dict[str, Tally]) -> list[dict[str, Any]]:
    """Per speculative row: draft ms per proposed token, verify ms per call, both relative to the target's ms per
    decoded token (baseline), and the speedups they predict next to the measured one."""
    baseline = tallies[BASELINE]
    target_ms = sum(baseline.decode_ms_per_token) / len(baseline.decode_ms_per_token)
    records = []
    for row in rows:
        t = tallies[row.name]
        if row.mode is None or not t.target_calls:
            continue
        a = t.acceptance_rate or 0.0
        alpha = per_token_alpha(t.tokens_per_target_call, row.k)
        draft_ms = 1e3 * t.draft_s / t.proposed if t.proposed else 0.0
        verify_ms = 1e3 * t.verify_s / t.target_calls
        k_eff = t.proposed / t.target_calls  # < k when the last rounds or ngram propose fewer
        c, v = draft_ms / target_ms, verify_ms / target_ms
        records.append({
            "row": row.name, "k": row.k, "acceptance_rate": a, "alpha": alpha, "proposed_per_call": k_eff,
            "tokens_per_target_call": t.tokens_per_target_call, "draft_ms_per_proposed_token": draft_ms,
            "verify_ms_per_call": verify_ms, "target_ms_per_token": target_ms, "c": c, "v": v,
            "expected_speedup": expected_speedup(alpha, row.k, c),
            "expected_speedup_no_draft_cost": expected_speedup(alpha, row.k, 0.0),
            "expected_speedup_measured_costs": t.tokens_per_target_call / (k_eff * c + v),
            "measured_speedup": t.tokens_per_s / baseline.tokens_per_s,
        })
    return records


def print_analysis(records: list[dict[str, Any]], tallies: dict[str, Tally]) -> None:
    baseline = tallies[BASELINE]
    target_ms = records[0]["target_ms_per_token"] if records else 0.0
    prefill = sum(baseline.prefill_ms) / len(baseline.prefill_ms)
    print(f"costs, in target decode steps: target alone {target_ms:.1f} ms per decoded token (prefill "
          f"{prefill:.0f} ms per prompt); c = draft ms per proposed token (its prefill included) / that, v = verify "
          "ms per call / that; alpha = per-token acceptance that reproduces the measured tokens per call; expected "
          "speedup (1 - alpha^(k+1)) / ((1 - alpha) (k c + v)), prefill excluded")
    for r in records:
        print(f"  {r['row']:<18} draft {r['draft_ms_per_proposed_token']:5.1f} ms (c = {r['c']:.2f}), verify "
              f"{r['verify_ms_per_call']:5.1f} ms (v = {r['v']:.2f}), {r['proposed_per_call']:.2f} proposed/call, "
              f"alpha = {r['alpha']:.2f} → expected {r['expected_speedup']:.2f}x with v = 1, "
              f"{r['expected_speedup_measured_costs']:.2f}x with the measured v, "
              f"{r['expected_speedup_no_draft_cost']:.2f}x with a free draft and v = 1; measured "
              f"{r['measured_speedup']:.2f}x")


def target_verdict(rows: list[Row], tallies: dict[str, Tally]) -> dict[str, Any]:
    baseline = tallies[BASELINE]
    candidates = [row for row in rows if row.mode == TARGET_MODE]
    best = max(candidates, key=lambda row: tallies[row.name].tokens_per_s)
    speedup = tallies[best.name].tokens_per_s / baseline.tokens_per_s
    identical = all(greedy_verdict(tallies[row.name], baseline)[0] for row in candidates)
    met = speedup >= TARGET_SPEEDUP and identical
    return {"row": best.name, "k": best.k, "speedup": speedup, "identical": identical, "met": met}


# --- the run -----------------------------------------------------------------------------------------------------

def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    if args.quick:
        args.prompts, args.new_tokens, args.ks = min(args.prompts, 2), min(args.new_tokens, 24), [4]
    if args.new_tokens < 2 or args.threads < 1 or args.repeats < 1:
        parser.error("--new-tokens must be at least 2, --threads and --repeats at least 1")
    if not 1 <= args.prompts <= len(NATURAL_PROMPTS):
        parser.error(f"--prompts must be between 1 and {len(NATURAL_PROMPTS)}")
    if not 1 <= args.concurrency <= len(EDITING_PARAGRAPHS):
        parser.error(f"--concurrency must be between 1 and {len(EDITING_PARAGRAPHS)}")
    if args.layers < 1:
        parser.error("--layers must be at least 1")
    source = resolve_source(args.model)
    env = environment()
    print(f"model {source.name} (fp32 target) | {args.new_tokens} new tokens | {args.threads} threads | greedy | "
          f"fastest of {args.repeats} | {env['cpus']} CPUs ({env['machine']}) | onnxruntime {env['onnxruntime']} | "
          f"{load_average()}", flush=True)
    start = time.perf_counter()
    out: dict[str, Any] = {"environment": env}
    if {"natural", "editing"} & set(args.tables):
        out |= run_batch_one(args, parser, source.name)
    if "concurrency" in args.tables:
        out["concurrency"] = run_concurrency(args, source.name)
    print(f"measured in {time.perf_counter() - start:.0f} s")
    if args.json:
        args.json.write_text(json.dumps(out, indent=2) + "\n")
        print(f"wrote {args.json}")


def run_batch_one(args: argparse.Namespace, parser: argparse.ArgumentParser, model_name: str) -> dict[str, Any]:
    """The natural and editing tables: every draft mode against no speculation, one request at a time."""
    layers_mode = f"self-layers:{args.layers}"
    artifacts = {mode: ensure_artifact(args.model, model_name, mode, args.recompile)
                 for mode in ("self-int4", layers_mode, "ngram")}
    rows = [Row(BASELINE, None, artifacts["self-int4"])]
    rows += [Row(f"self-int4 k={k}", "self-int4", artifacts["self-int4"], k) for k in args.ks]
    if 4 in args.ks:
        rows += [Row("self-int4 k=4 float draft", "self-int4", artifacts["self-int4"], 4, int8_activations=False),
                 Row("self-int4 k=4 unrolled", "self-int4", artifacts["self-int4"], 4, True, False)]
    rows += [Row(f"{layers_mode} k=4", layers_mode, artifacts[layers_mode], 4),
             Row("ngram k=4", "ngram", artifacts["ngram"], 4)]
    engines = load_engines(rows, args.threads)
    tokenizer = engines[BASELINE].tokenizer
    natural = [list(tokenizer.encode(p)) for p in NATURAL_PROMPTS[:args.prompts]]
    editing = [list(tokenizer.encode(EDITING_PROMPT))]
    max_positions = engines[BASELINE].max_context
    if max(len(ids) for ids in natural + editing) + args.new_tokens > max_positions:
        parser.error(f"the prompts plus {args.new_tokens} new tokens exceed the context of {max_positions}")
    warm_up(rows, engines, natural[0])
    sets = {"natural": natural, "editing": editing}
    labels = {"natural": f"natural prompts ({len(natural)}: "
                         f"{', '.join(str(len(ids)) for ids in natural)} tokens)",
              "editing": f"editing prompt (repeat a paragraph; {len(editing[0])} tokens)"}
    results: dict[str, Any] = {}
    for name in (table for table in ("natural", "editing") if table in args.tables):
        print(f"\n{labels[name]}, {args.new_tokens} new tokens each, batch 1", flush=True)
        tallies = measure_set(rows, engines, sets[name], args.new_tokens, args.repeats)
        print(format_table(rows, tallies))
        records = analysis(rows, tallies)
        print_analysis(records, tallies)
        results[name] = {"tallies": tallies, "analysis": records}
    verdict = None
    if "natural" in results:
        verdict = target_verdict(rows, results["natural"]["tallies"])
        print(f"\ntarget: {TARGET_MODE} at its best k >= {TARGET_SPEEDUP}x over no speculation with identical "
              f"greedy output (natural prompts): {verdict['row']} is {verdict['speedup']:.2f}x, greedy "
              f"{'identical' if verdict['identical'] else 'NOT identical'} → {'MET' if verdict['met'] else 'MISSED'}")

    def table(tallies: dict[str, Tally]) -> list[dict[str, Any]]:
        baseline = tallies[BASELINE]
        return [{"row": row.name, "mode": row.mode, "k": row.k, "wall_s": tallies[row.name].wall_s,
                 "tokens": tallies[row.name].tokens, "tokens_per_s": tallies[row.name].tokens_per_s,
                 "speedup": tallies[row.name].tokens_per_s / baseline.tokens_per_s,
                 "acceptance_rate": tallies[row.name].acceptance_rate,
                 "tokens_per_target_call": tallies[row.name].tokens_per_target_call,
                 "proposed": tallies[row.name].proposed, "accepted": tallies[row.name].accepted,
                 "target_calls": tallies[row.name].target_calls, "draft_s": tallies[row.name].draft_s,
                 "verify_s": tallies[row.name].verify_s,
                 "greedy_identical": greedy_verdict(tallies[row.name], baseline)[0],
                 "token_ids": tallies[row.name].token_ids} for row in rows]

    config = {"model": args.model, "new_tokens": args.new_tokens, "prompts": NATURAL_PROMPTS[:args.prompts],
              "editing_prompt": EDITING_PROMPT, "ks": args.ks, "layers": args.layers, "threads": args.threads,
              "repeats": args.repeats, "artifacts": {mode: str(path) for mode, path in artifacts.items()}}
    return {"config": config, "target": verdict,
            "results": {name: {"rows": table(r["tallies"]), "analysis": r["analysis"]} for name, r in results.items()}}


def main() -> None:
    script_main(run, build_parser, "speculative.py")


if __name__ == "__main__":
    main()
