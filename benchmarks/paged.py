"""Paged KV cache and continuous batching benchmark: memory admission, KV waste, batched decode throughput and prefix
caching of fxllm's paged artifacts, in one run.

Four tables:

(a) Admission at a fixed KV budget (--budget, default 256MB, read as the engine reads kv_cache_memory). The budget
    buys budget // (block_size * bytes_per_token) blocks, with bytes_per_token = 2 * layers * kv_heads * head_dim * 4
    from the artifact's spec (46,080 for SmolLM2-135M). A static engine reserves --max-len tokens per sequence, so it
    holds budget // (max_len * bytes_per_token) sequences. The paged side allocates sequences whose lengths are drawn
    uniformly from [64, max_len] and from [64, max_len/2] (means about max_len/2 and max_len/4) in a real
    BlockManager (prefix caching off, random tokens) until it raises OutOfBlocks, and counts them; --trials draws
    with seeds --seed, --seed+1, ... are averaged. Target: paged/static >= 3x for the [64, max_len/2] workload.
(b) KV waste of the same filled states: allocated but unfilled slots / allocated slots, BlockManager.waste() for
    paging, 1 - mean_len / max_len for static allocation. Target: paging < 4%.
(c) Decode throughput of the real paged artifact (--threads intra-op threads): generated tokens per second of wall
    time (prefill included) for 1, 8 and --requests (32) concurrent requests (distinct real-text prompts of 32-64
    tokens, --new-tokens each, greedy, EOS disabled so every request emits exactly --new-tokens tokens), and for
    the same --requests run one at a time. The speedup of all-concurrent over one-at-a-time should be >= 6x; every
    concurrent output is checked against the sequential one (greedy tokens identical: yes/no). Prefix caching is
    off here, so no run profits from prompts an earlier run left in the cache.
(d) Prefix caching: --requests requests sharing a --system-tokens (256) token system prompt (real text, repeated
    and truncated by tokens) plus distinct short questions, on an engine with prefix_caching=True and on one
    without. Reports the prefix hit rate (prompt blocks found in the cache), prefill tokens computed, prefill
    time, the prefill time saved, and whether the two runs' greedy outputs are identical.

Every engine gets the same KV budget, max_batch=64 and max_tokens_per_step=512. The scheduler prefills one request
per iteration and then decodes every running request once, so the decode batch ramps up as requests are admitted
and down as they finish; the tables show each run's mean and max decode batch and its prefill/decode split.

    .venv/bin/python benchmarks/paged.py                     # SmolLM2-135M, 256MB, max_len 2048, 32 requests
    .venv/bin/python benchmarks/paged.py --quick             # smoke run: fewer trials, requests and tokens
    .venv/bin/python benchmarks/paged.py --budget 1GB --max-len 4096 --json paged.json

Without --artifact, MODEL is compiled once with PAGED_PASSES into ~/.cache/fxllm/bench/<model>--paged and reused
while its recorded passes match (--recompile rebuilds it).
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

import fxllm
from decode import CACHE_DIR, ensure_artifact, environment, first_difference, script_main
from fxllm.compiler.sources import resolve_source
from fxllm.runtime.contract import ModelIO, ModelSpec, TensorSig
from fxllm.errors import FxllmError
from fxllm.runtime.manifest import load_manifest
from fxllm.runtime.block_manager import BlockManager, OutOfBlocks
from fxllm.runtime.paged_cache import parse_bytes

PAGED_PASSES = "cleanup,gqa,fuse-projections,select-logits,kv-cache,paged:block_size={block_size}"
MIN_LEN = 64  # shortest sequence of the admission workloads
PROMPT_TOKENS = (32, 64)  # throughput prompts: lengths drawn from this range
TARGET_ADMISSION = 3.0  # paged/static sequences, [64, max_len/2] workload
TARGET_WASTE = 0.04  # paged KV waste
TARGET_SPEEDUP = 6.0  # all-concurrent over one-at-a-time tokens/s

# Real text for the prompts (c): windows of its tokens, one per request.
CORPUS = """\
The lighthouse at the end of the northern breakwater was built in 1872, after two winters in which more than a
dozen fishing boats were lost on the rocks outside the harbour. Its first keeper, a retired ship's carpenter, kept a
log of every vessel that passed, the direction of the wind and the height of the swell, and those notebooks are now
the oldest continuous weather record on this stretch of coast.

Bread is one of the oldest prepared foods. Grinding grain between stones, mixing the flour with water and baking the
dough on hot surfaces was practised long before anyone understood yeast. Leavened bread spread slowly, carried by
traders and soldiers, and every region adapted it to its own grain: rye in the cold north, wheat on the plains,
maize and barley wherever wheat would not grow.

A river changes its course more often than a map suggests. During a flood the water cuts across the neck of a bend,
leaving the old loop behind as a quiet lake, and the new channel begins at once to carve its own curves. Farmers
along the lower valley have learned to read these shifts in the colour of the soil and in the lines of willows that
mark where the banks used to be.

The first mechanical clocks had no faces and no hands. They struck a bell at each hour so that monks would know
when to pray, and the word clock itself comes from an old word for bell. Dials came later, and minute hands later
still, once the escapements were precise enough that a minute meant something.

Honeybees communicate the location of food through a dance. A forager returning to the hive runs in a straight line
while waggling her body, then circles back and repeats; the angle of the run relative to vertical gives the
direction of the flowers relative to the sun, and the length of the waggle encodes the distance.

When the railway reached the valley, the town's clocks were set to the time of the capital rather than to the sun,
and for a generation the church kept its own noon while the station kept the timetable's. Travellers learned to ask
which time was meant, and the baker opened by the church bell but closed by the train.

Glass is made by melting sand with soda and lime until the mixture flows like syrup, then cooling it quickly enough
that the atoms have no time to settle into a crystal. The old belief that cathedral windows are thicker at the
bottom because glass flows over centuries is a myth; the panes were uneven when they were made, and glaziers set
the heavy edge downwards.
"""

# The shared system prompt (d): repeated until it is long enough, then truncated to --system-tokens tokens.
SYSTEM_TEXT = """\
You are a careful assistant for a public library. Answer questions about the library's services, opening hours and
collections politely and briefly. If you do not know an answer, say so and suggest asking a librarian at the front
desk. The library opens at nine in the morning on weekdays and at ten on Saturdays; it is closed on Sundays and
public holidays. Members may borrow up to twelve items at a time for three weeks, renewable twice unless another
member has reserved the item. The reading room on the second floor is for quiet study; the children's section on
the ground floor hosts story time every Wednesday afternoon. Printing costs ten cents a page.
"""

QUESTION_TOPICS = [
    "the opening hours on Saturday", "how many books I can borrow", "renewing a loan", "story time",
    "the reading room", "printing", "public holidays", "reserving a book", "the children's section",
    "borrowing films", "late returns", "the second floor", "Sunday opening", "finding a librarian",
    "quiet study", "loan periods", "how renewals work", "weekday hours", "borrowing limits for children",
    "printing in colour", "lost library cards", "joining the library", "group study", "the front desk",
    "reserved items", "Wednesday afternoons", "wireless internet", "photocopying", "local history books",
    "returning books after closing", "audiobooks", "donating books", "accessibility", "parking",
    "visiting with a school class", "newspapers", "research help", "language courses",
]


# --- arguments ---------------------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m", help="HF directory, .gguf file or 'smollm2-135m'")
    parser.add_argument("--artifact", type=Path, help="a compiled paged artifact of MODEL (default: compile once "
                                                      "into ~/.cache/fxllm/bench/<model>--paged and reuse it)")
    parser.add_argument("--recompile", action="store_true", help="rebuild the cached artifact")
    parser.add_argument("--block-size", type=int, default=16, help="KV block size when compiling (default 16)")
    parser.add_argument("--budget", default="256MB", help="KV cache memory of every engine and of table (a)")
    parser.add_argument("--max-len", type=int, default=2048, help="static allocation length, longest sequence of (a)")
    parser.add_argument("--trials", type=int, help="admission draws averaged in (a) (default 200, --quick 20)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--requests", type=int, help="requests of (c) and (d) (default 32, --quick 8)")
    parser.add_argument("--new-tokens", type=int, help="new tokens per request in (c) and (d) (default 32, --quick 8)")
    parser.add_argument("--system-tokens", type=int, default=256, help="shared system prompt length of (d)")
    parser.add_argument("--threads", type=int, default=2, help="intra-op threads of every engine")
    parser.add_argument("--quick", action="store_true", help="smoke run: fewer trials, requests and tokens")
    parser.add_argument("--json", type=Path, help="also write the results here")
    return parser


def check_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    args.trials = args.trials or (20 if args.quick else 200)
    args.requests = args.requests or (8 if args.quick else 32)
    args.new_tokens = args.new_tokens or (8 if args.quick else 32)
    if args.max_len < 2 * MIN_LEN:
        parser.error(f"--max-len must be at least {2 * MIN_LEN}")
    if min(args.trials, args.requests, args.new_tokens, args.threads, args.system_tokens) < 1:
        parser.error("--trials, --requests, --new-tokens, --threads and --system-tokens must be at least 1")
    if args.requests > len(QUESTION_TOPICS):
        parser.error(f"--requests is at most {len(QUESTION_TOPICS)} (the number of distinct questions of (d))")
    try:
        args.budget_bytes = parse_bytes(args.budget)
    except FxllmError as exc:
        parser.error(str(exc))


# --- artifact ----------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Layout:
    """What the benchmark needs from the artifact's manifest."""
    block_size: int
    bytes_per_token: int  # float32 K and V, all layers
    max_positions: int
    vocab_size: int

    @property
    def block_bytes(self) -> int:
        return self.block_size * self.bytes_per_token


def prepare_artifact(args: argparse.Namespace, parser: argparse.ArgumentParser) -> tuple[Path, dict[str, Any]]:
    if args.artifact:
        directory, manifest = args.artifact, load_manifest(args.artifact, verify=False).data  # fxllm.load verifies
    else:
        name = resolve_source(args.model).name
        suffix = "paged" if args.block_size == 16 else f"paged-bs{args.block_size}"
        directory = CACHE_DIR / f"{name}--{suffix}"
        manifest = ensure_artifact(args.model, directory, PAGED_PASSES.format(block_size=args.block_size),
                                   args.recompile)
    if "paged" not in manifest.get("facts", []):
        parser.error(f"{directory} is not a paged artifact (compile it with the 'paged' pass)")
    return directory, manifest


def layout(manifest: dict[str, Any]) -> Layout:
    spec = ModelSpec.from_dict(manifest["spec"])
    io = ModelIO.from_signature([TensorSig.from_dict(sig) for sig in manifest["io"]["inputs"]],
                                [TensorSig.from_dict(sig) for sig in manifest["io"]["outputs"]])
    return Layout(int(io.block_size), spec.kv_bytes_per_token(),
                  spec.max_positions, spec.vocab_size)


# --- tables ------------------------------------------------------------------------------------------------------

def table(header: list[str], rows: list[list[str]]) -> str:
    """A markdown table: first column left-aligned, the others right-aligned."""
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        padded = [cells[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(cells[1:], widths[1:])]
        return "| " + " | ".join(padded) + " |"

    rule = "|" + "|".join(["-" * (widths[0] + 2)] + ["-" * (w + 1) + ":" for w in widths[1:]]) + "|"
    return "\n".join([line(header), rule, *(line(row) for row in rows)])


def verdict(met: bool) -> str:
    return "met" if met else "MISSED"


def ratio_text(value: float | None) -> str:
    return f"{value:.2f}x" if value is not None else "n/a"


# --- (a) and (b): admission and waste ----------------------------------------------------------------------------

@dataclass
class Admission:
    workload: str
    low: int
    high: int
    trials: int
    static_sequences: int
    paged_sequences_mean: float
    paged_sequences_min: int
    paged_sequences_max: int
    mean_len: float  # of the sequences the paged side placed, all trials
    paged_waste: float  # mean over trials of BlockManager.waste() when full
    static_waste: float  # 1 - mean_len / max_len

    @property
    def ratio(self) -> float | None:
        return self.paged_sequences_mean / self.static_sequences if self.static_sequences else None


def fill(num_blocks: int, block_size: int, low: int, high: int, vocab: int,
         rng: np.random.Generator) -> tuple[list[int], float]:
    """Allocate sequences of lengths uniform in [low, high] until OutOfBlocks: their lengths and the waste then."""
    manager = BlockManager(num_blocks, block_size, enable_prefix_caching=False)
    lengths: list[int] = []
    while True:
        length = int(rng.integers(low, high + 1))
        try:
            manager.allocate(len(lengths), rng.integers(0, vocab, length).tolist())
        except OutOfBlocks:
            return lengths, manager.waste()
        lengths.append(length)


def measure_admission(args: argparse.Namespace, lay: Layout) -> list[Admission]:
    num_blocks = args.budget_bytes // lay.block_bytes
    static = args.budget_bytes // (args.max_len * lay.bytes_per_token)
    results = []
    for name, high in (("mean ~max_len/2", args.max_len), ("mean ~max_len/4", args.max_len // 2)):
        counts, wastes, placed = [], [], []
        for trial in range(args.trials):
            lengths, waste = fill(num_blocks, lay.block_size, MIN_LEN, high, lay.vocab_size,
                                  np.random.default_rng(args.seed + trial))
            counts.append(len(lengths))
            wastes.append(waste)
            placed.extend(lengths)
        mean_len = float(np.mean(placed)) if placed else 0.0
        results.append(Admission(f"uniform [{MIN_LEN}, {high}] ({name})", MIN_LEN, high, args.trials, static,
                                 float(np.mean(counts)), min(counts), max(counts), mean_len,
                                 float(np.mean(wastes)), 1 - mean_len / args.max_len))
    return results


def report_admission(args: argparse.Namespace, lay: Layout, results: list[Admission]) -> None:
    num_blocks = args.budget_bytes // lay.block_bytes
    print(f"\n(a) admission at a KV budget of {args.budget} ({args.budget_bytes:,} bytes): "
          f"{lay.bytes_per_token:,} bytes/token, {num_blocks} blocks of {lay.block_size} tokens "
          f"({num_blocks * lay.block_size:,} tokens); static reserves {args.max_len} tokens/sequence; "
          f"mean of {args.trials} draws (seeds {args.seed}..{args.seed + args.trials - 1})")
    print(table(["workload", "mean len", "static seqs", "paged seqs (mean)", "paged min-max", "paged/static"],
                [[r.workload, f"{r.mean_len:.0f}", str(r.static_sequences), f"{r.paged_sequences_mean:.2f}",
                  f"{r.paged_sequences_min}-{r.paged_sequences_max}", ratio_text(r.ratio)] for r in results]))
    quarter = results[-1]
    print(f"paged/static for {quarter.workload}: {ratio_text(quarter.ratio)} "
          f"(target >= {TARGET_ADMISSION:.0f}x: {verdict((quarter.ratio or 0) >= TARGET_ADMISSION)})")
    print("\n(b) KV waste (allocated but unfilled slots / allocated slots) of the filled states of (a)")
    print(table(["workload", "paged waste", "static waste"],
                [[r.workload, f"{r.paged_waste:.2%}", f"{r.static_waste:.2%}"] for r in results]))
    worst = max(r.paged_waste for r in results)
    print(f"paged waste at most {worst:.2%} (target < {TARGET_WASTE:.0%}: {verdict(worst < TARGET_WASTE)})")


# --- engine runs -------------------------------------------------------------------------------------------------

@dataclass
class RunStats:
    label: str
    requests: int
    tokens: int  # generated, counted from the results
    wall_s: float
    prefill_s: float
    decode_s: float
    prefill_tokens: int  # computed in prefill
    prefill_cached_tokens: int
    prompt_tokens: int
    decode_steps: int
    mean_decode_batch: float
    max_decode_batch: int
    preemptions: int
    prefix_hit_rate: float
    peak_blocks_used: int
    outputs: list[list[int]]

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s

    @property
    def decode_ms_per_step(self) -> float:
        return self.decode_s * 1e3 / self.decode_steps if self.decode_steps else 0.0

    def summary(self) -> dict[str, Any]:
        record = asdict(self)
        del record["outputs"]
        return {**record, "tokens_per_s": self.tokens_per_s, "decode_ms_per_step": self.decode_ms_per_step}


def load_engine(artifact: Path, args: argparse.Namespace, prefix_caching: bool) -> Any:
    engine = fxllm.load(artifact, threads=args.threads, kv_cache_memory=args.budget, max_batch=64,
                        max_tokens_per_step=512, prefix_caching=prefix_caching)
    engine.eos_token_ids = set()  # every request emits exactly --new-tokens tokens
    # Warm-up: a 12-token prompt and 4 tokens fill no block, so they leave nothing in the prefix cache and add no
    # prefix-cache lookups (a prompt of n tokens looks up (n - 1) // block_size blocks).
    engine.generate_ids([list(range(1000, 1012)), list(range(2000, 2012))], max_new_tokens=4)
    return engine


def run_batch(engine: Any, label: str, prompts: list[list[int]], new_tokens: int) -> RunStats:
    """All prompts in one generate call (continuous batching)."""
    engine.core.reset_peak_stats()
    before = engine.stats()
    start = time.perf_counter()
    results = engine.generate_ids(prompts, max_new_tokens=new_tokens)
    wall = time.perf_counter() - start
    m = engine.stats().since(before)
    return RunStats(label, len(prompts), sum(len(r.token_ids) for r in results), wall, m.prefill_seconds,
                    m.decode_seconds, m.prefill_tokens, m.prefill_cached_tokens,
                    sum(len(p) for p in prompts), m.decode_steps, round(m.mean_decode_batch, 2), m.max_decode_batch,
                    m.preemptions, round(m.prefix_cache_hit_rate, 4), m.peak_kv_blocks_used,
                    [list(r.token_ids) for r in results])


def run_sequential(engine: Any, label: str, prompts: list[list[int]], new_tokens: int) -> RunStats:
    """One generate call per prompt, one after another."""
    runs = [run_batch(engine, label, [prompt], new_tokens) for prompt in prompts]
    steps = sum(r.decode_steps for r in runs)
    return RunStats(label, len(prompts), sum(r.tokens for r in runs), sum(r.wall_s for r in runs),
                    sum(r.prefill_s for r in runs), sum(r.decode_s for r in runs),
                    sum(r.prefill_tokens for r in runs), sum(r.prefill_cached_tokens for r in runs),
                    sum(r.prompt_tokens for r in runs), steps, 1.0 if steps else 0.0,
                    max(r.max_decode_batch for r in runs), sum(r.preemptions for r in runs), 0.0,
                    max(r.peak_blocks_used for r in runs), [r.outputs[0] for r in runs])


def identical(run: RunStats, reference: RunStats) -> str:
    """Whether every output of `run` equals the reference's output for the same prompt."""
    differing = [(i, first_difference(a, b)) for i, (a, b) in enumerate(zip(run.outputs, reference.outputs))
                 if a != b]
    if not differing:
        return "yes"
    i, token = differing[0]
    return f"no ({len(differing)}/{run.requests} differ; first: request {i} from token {token})"


# --- (c): decode throughput --------------------------------------------------------------------------------------

def throughput_prompts(tokenizer: Any, count: int, seed: int) -> list[list[int]]:
    """`count` distinct windows of the corpus's tokens, of lengths drawn from PROMPT_TOKENS."""
    ids = list(tokenizer.encode(CORPUS))
    low, high = PROMPT_TOKENS
    if len(ids) < high + count:
        raise SystemExit(f"paged.py: the corpus has {len(ids)} tokens, too few for {count} prompts")
    rng = np.random.default_rng(seed)
    stride = (len(ids) - high) // count
    prompts = [ids[i * stride:i * stride + int(rng.integers(low, high + 1))] for i in range(count)]
    assert len({tuple(p) for p in prompts}) == count, "throughput prompts are not distinct"
    return prompts


def measure_throughput(engine: Any, args: argparse.Namespace, prompts: list[list[int]]) -> dict[str, Any]:
    print(f"\n(c) decode throughput: {len(prompts)} distinct prompts of {min(map(len, prompts))}-"
          f"{max(map(len, prompts))} tokens, {args.new_tokens} new tokens each, greedy, EOS off, "
          f"{args.threads} threads, prefix caching off", flush=True)
    sequential = run_sequential(engine, f"{len(prompts)} requests one at a time", prompts, args.new_tokens)
    runs = [sequential]
    for level in sorted({n for n in (1, 8, len(prompts)) if n <= len(prompts)}):
        runs.append(run_batch(engine, f"{level} concurrent", prompts[:level], args.new_tokens))
    concurrent = runs[-1]
    print(table(["run", "requests", "tokens", "wall s", "tokens/s", "prefill s", "decode s", "decode steps",
                 "ms/decode step", "mean batch", "max batch", "preempt", "identical to sequential"],
                [[r.label, str(r.requests), str(r.tokens), f"{r.wall_s:.2f}", f"{r.tokens_per_s:.1f}",
                  f"{r.prefill_s:.2f}", f"{r.decode_s:.2f}", str(r.decode_steps), f"{r.decode_ms_per_step:.1f}",
                  f"{r.mean_decode_batch:.2f}", str(r.max_decode_batch), str(r.preemptions),
                  "(reference)" if r is sequential else identical(r, sequential)] for r in runs]))
    speedup = concurrent.tokens_per_s / sequential.tokens_per_s
    same = identical(concurrent, sequential)
    print(f"speedup, {concurrent.label} over {sequential.label}: {speedup:.2f}x "
          f"(target >= {TARGET_SPEEDUP:.0f}x: {verdict(speedup >= TARGET_SPEEDUP)})")
    detail = "" if same == "yes" else f": {same}"
    print(f"identical: {same.split()[0]}  ({concurrent.label} vs one at a time, greedy tokens{detail})")
    for r in (sequential, concurrent):
        print(f"  {r.label}: prefill {r.prefill_s / r.wall_s:.0%} of wall, decode {r.decode_s / r.wall_s:.0%}, "
              f"other {1 - (r.prefill_s + r.decode_s) / r.wall_s:.0%}; "
              f"decode {(r.tokens - r.requests) / r.decode_s if r.decode_s else 0:.1f} tokens/s over "
              f"{r.decode_steps} steps of mean batch {r.mean_decode_batch:.2f}")
    return {"runs": [r.summary() for r in runs], "speedup": speedup, "identical": same == "yes",
            "identical_detail": same}


# --- (d): prefix caching -----------------------------------------------------------------------------------------

def prefix_prompts(tokenizer: Any, count: int, system_tokens: int) -> tuple[list[int], list[list[int]]]:
    """A `system_tokens`-token system prompt (SYSTEM_TEXT repeated, truncated by tokens) and `count` prompts that
    append a distinct short question to it."""
    system = list(tokenizer.encode(SYSTEM_TEXT))
    while len(system) < system_tokens:
        system = list(tokenizer.encode(" ".join([SYSTEM_TEXT] * (system_tokens // max(len(system), 1) + 2))))
    system = system[:system_tokens]
    questions = [list(tokenizer.encode(f"\n\nQuestion: Can you tell me about {topic}?\nAnswer:"))
                 for topic in QUESTION_TOPICS[:count]]
    return system, [system + q for q in questions]


def measure_prefix(engine_off: Any, artifact: Path, args: argparse.Namespace, tokenizer: Any,
                   lay: Layout) -> dict[str, Any]:
    system, prompts = prefix_prompts(tokenizer, args.requests, args.system_tokens)
    print(f"\n(d) prefix caching: {len(prompts)} requests = a {len(system)}-token shared system prompt + a distinct "
          f"question ({min(map(len, prompts)) - len(system)}-{max(map(len, prompts)) - len(system)} tokens), "
          f"{args.new_tokens} new tokens each, KV budget {args.budget}", flush=True)
    off = run_batch(engine_off, "prefix caching off", prompts, args.new_tokens)
    engine_on = load_engine(artifact, args, prefix_caching=True)
    on = run_batch(engine_on, "prefix caching on", prompts, args.new_tokens)
    runs = [on, off]
    print(table(["run", "prefix hit rate", "prompt tokens", "prefill computed", "prefill cached", "prefill s",
                 "decode s", "wall s", "mean batch", "peak blocks", "preempt"],
                [[r.label, f"{r.prefix_hit_rate:.1%}", str(r.prompt_tokens), str(r.prefill_tokens),
                  str(r.prefill_cached_tokens), f"{r.prefill_s:.2f}", f"{r.decode_s:.2f}", f"{r.wall_s:.2f}",
                  f"{r.mean_decode_batch:.2f}", str(r.peak_blocks_used), str(r.preemptions)] for r in runs]))
    saved = 1 - on.prefill_s / off.prefill_s if off.prefill_s else 0.0
    speedup = off.prefill_s / on.prefill_s if on.prefill_s else None
    computed = 1 - on.prefill_tokens / off.prefill_tokens if off.prefill_tokens else 0.0
    same = identical(on, off)
    print(f"prefill time saved: {saved:.1%} (off/on {ratio_text(speedup)}); prefill tokens computed "
          f"{computed:.1%} fewer; wall {off.wall_s / on.wall_s:.2f}x")
    detail = "" if same == "yes" else f": {same}"
    print(f"identical: {same.split()[0]}  (prefix caching on vs off, greedy tokens{detail})")
    if off.preemptions:
        print(f"  note: without prefix caching the {args.budget} pool ({args.budget_bytes // lay.block_bytes} blocks) "
              f"ran out {off.preemptions} times; preempted requests recompute their tokens, which is part of the "
              f"prefill computed above")
    return {"system_tokens": len(system), "runs": [r.summary() for r in runs], "prefill_time_saved": saved,
            "prefill_speedup": speedup, "identical": same == "yes", "identical_detail": same}


# --- the run -----------------------------------------------------------------------------------------------------

def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    check_args(args, parser)
    wall_start = time.perf_counter()
    artifact, manifest = prepare_artifact(args, parser)
    lay = layout(manifest)
    if args.max_len > lay.max_positions:
        parser.error(f"--max-len {args.max_len} exceeds the model's context of {lay.max_positions}")
    env = environment()
    print(f"model {manifest['source']['name']} | artifact {artifact} | block size {lay.block_size} | "
          f"KV budget {args.budget} | {args.threads} threads | {env['cpus']} CPUs ({env['machine']}) | "
          f"onnxruntime {env['onnxruntime']}{' | --quick' if args.quick else ''}", flush=True)

    admission = measure_admission(args, lay)
    report_admission(args, lay, admission)

    engine = load_engine(artifact, args, prefix_caching=False)
    prompts = throughput_prompts(engine.tokenizer, args.requests, args.seed)
    throughput = measure_throughput(engine, args, prompts)
    prefix = measure_prefix(engine, artifact, args, engine.tokenizer, lay)
    wall = time.perf_counter() - wall_start
    print(f"\nbenchmark wall time {wall:.0f} s")

    if args.json:
        config = {key: (str(value) if isinstance(value, Path) else value) for key, value in vars(args).items()}
        config["artifact"] = str(artifact)
        result = {"config": config, "environment": env, "layout": asdict(lay),
                  "admission": [{**asdict(a), "ratio": a.ratio} for a in admission],
                  "throughput": throughput, "prefix": prefix, "wall_s": wall}
        args.json.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.json}")


def main() -> None:
    script_main(run, build_parser, "paged.py")


if __name__ == "__main__":
    main()
