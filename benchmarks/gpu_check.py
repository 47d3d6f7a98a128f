"""The prepared GPU check (issue #15): everything a lent GPU machine should measure, in one run, from the working tree.

Rows (each printed, and all written to --out):
  env        GPU, driver, CUDA, torch, transformers, Python
  parity     greedy tokens of the `torch` target (fp32, contiguous and paged) against transformers on the same
             device: 4 prompts x 32 new tokens, SmolLM2-135M-shaped model
  decode     bf16 decode ms/token at batch 1 and tokens/s at batch 32 (prompt 64 tokens, 64 new), fxllm torch backend
             (contiguous, paged; contiguous through torch.compile, timed last) vs transformers eager and transformers
             + torch.compile with a static cache, in interleaved rounds (medians), per model: Llama-3.2-1B-shaped,
             then SmolLM2-135M-shaped
  floor      the HBM-bandwidth floor for batch-1 decode: bytes read per token (bf16 weights + the KV cache at the
             mean context) / the device-to-device copy bandwidth measured in the same run; ratio of each row to it
  time       seconds spent building and compiling each model (to size the next run)

Order: env, the 1B-shaped decode rows, parity, then the SmolLM2-shaped decode rows (the issue's targets first). A
time budget (--budget-s) is checked before every model build, compile, warm-up and timed round; what it cuts off
says "skipped: time budget spent", and the results file is rewritten after every row, so a run stopped from
outside keeps everything it measured.
Models are random-weight models built from real configs (no downloads; speed does not depend on weight values),
with a byte-level tokenizer built here (the benchmarks feed token ids). Context is capped at 8192 positions.
Without a CUDA device it runs CI-sized on CPU: a 2-layer model for parity, and every GPU row says "no CUDA device"
(--cpu-decode runs the decode rows on CPU with tiny sizes, to exercise their code). See docs/gpu.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("FXLLM_QUIET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

NO_CUDA = "no CUDA device"
CONTEXT = 8192  # max_position_embeddings of the built models (the real configs allow more)
CONFIGS = {  # real architectures' shapes (SmolLM2-135M's and Llama-3.2-1B's config.json), random weights
    "smollm2-135m": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, head_dim=64, rms_norm_eps=1e-5,
                         rope_theta=100000.0, tie_word_embeddings=True),
    "llama-3.2-1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=64, rms_norm_eps=1e-5,
                         rope_theta=500000.0, tie_word_embeddings=True,
                         rope_scaling={"rope_type": "llama3", "factor": 32.0, "high_freq_factor": 4.0,
                                       "low_freq_factor": 1.0, "original_max_position_embeddings": 8192}),
    "tiny": dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0,
                 tie_word_embeddings=False),
}


@dataclass
class Sizes:
    parity_model: str
    decode_models: tuple[str, ...]
    parity_tokens: int = 32
    prompt: int = 64
    new: int = 64
    batch: int = 32
    rounds: int = 3


GPU_SIZES = Sizes("smollm2-135m", ("llama-3.2-1b", "smollm2-135m"))  # the targets are on the 1B model: first
CPU_SIZES = Sizes("tiny", ("tiny",), parity_tokens=8, prompt=8, new=8, batch=4, rounds=2)


@dataclass
class Report:
    """Rows printed as they come and the results file rewritten after each one, so a run cut short (the device
    tool's time limit) still leaves every row it measured."""

    path: Path | None = None
    rows: list[dict] = field(default_factory=list)

    def add(self, section: str, name: str, value: str, **data) -> None:
        row = {"section": section, "name": name, "value": value, **data}
        self.rows.append(row)
        print(f"{section:<8} {name:<44} {value}", flush=True)
        if self.path is not None:
            self.write(self.path)

    def write(self, path: Path) -> None:
        lines = [f"| {r['section']} | {r['name']} | {r['value']} |" for r in self.rows]
        text = "| section | row | value |\n| --- | --- | --- |\n" + "\n".join(lines) + "\n"
        path.write_text(text)
        path.with_suffix(".json").write_text(json.dumps(self.rows, indent=1))


def allow_missing_gguf() -> None:
    """The lent GPU machine has every package of the `compile` extra but `gguf`, which only GGUF sources use (this
    check builds Hugging Face directories). fxllm.compiler refuses to import without it, so a placeholder module
    stands in; any real use of it would fail loudly (it has no attributes)."""
    import importlib.machinery
    import types

    from fxllm.extras import missing_modules

    if missing_modules(("gguf",)):
        placeholder = types.ModuleType("gguf")
        placeholder.__spec__ = importlib.machinery.ModuleSpec("gguf", None)
        sys.modules["gguf"] = placeholder


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="gpu_check.md", help="results file (markdown; a .json beside it)")
    parser.add_argument("--work", help="directory for the built models and artifacts (default: a temporary one)")
    parser.add_argument("--cpu-decode", action="store_true", help="without CUDA, run the decode rows on CPU (tiny)")
    parser.add_argument("--budget-s", type=float, default=420.0, help="skip the remaining rows after this long")
    args = parser.parse_args(argv)
    allow_missing_gguf()
    import torch

    cuda = torch.cuda.is_available()
    sizes = GPU_SIZES if cuda else CPU_SIZES
    if not cuda:
        torch.set_num_threads(1)  # 2-layer models: extra threads only contend (badly, on a shared machine)
    device = "cuda" if cuda else "cpu"
    report = Report(Path(args.out))
    budget = Budget(time.monotonic() + args.budget_s)
    with tempfile.TemporaryDirectory(prefix="fxllm-gpu-check-") as scratch:
        work = Path(args.work or scratch)
        environment(report, torch, cuda)
        builder = ModelBuilder(work, device)
        bandwidth = copy_bandwidth(torch, device) if cuda else None
        # The targets first (the 1B-shaped decode rows, then parity), so a run cut short keeps them.
        decode_models = list(sizes.decode_models)
        for index, model in enumerate(decode_models):
            if not (cuda or args.cpu_decode):
                for name in decode_row_names(model, sizes):
                    report.add("decode", name, NO_CUDA)
                report.add("floor", f"{model} batch 1", floor_text(builder, model, sizes, None))
            elif budget.spent():
                report.add("decode", model, budget.SKIPPED)
            else:
                decode(report, builder, model, sizes, device, bandwidth, budget)
            if index == 0:
                parity(report, builder, sizes, device, budget)
        for step, seconds in builder.seconds.items():  # where the check's own time went (to size the next run)
            report.add("time", step, f"{seconds:.1f} s")
    print(f"results: {args.out}")
    return 0


@dataclass
class Budget:
    """The run's time budget: every row checks it before a model build, a compile, a warm-up or a timed round."""

    deadline: float
    SKIPPED = "skipped: time budget spent"

    def spent(self) -> bool:
        return time.monotonic() > self.deadline


def environment(report: Report, torch, cuda: bool) -> None:
    import transformers

    report.add("env", "python", platform.python_version())
    report.add("env", "torch", torch.__version__)
    report.add("env", "transformers", transformers.__version__)
    if not cuda:
        report.add("env", "gpu", NO_CUDA)
        report.add("env", "driver", NO_CUDA)
        return
    props = torch.cuda.get_device_properties(0)
    report.add("env", "gpu", f"{props.name}, {props.total_memory / 2**30:.0f} GiB, compute capability "
                             f"{props.major}.{props.minor}")
    report.add("env", "cuda (torch build)", str(torch.version.cuda))
    try:
        driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                capture_output=True, text=True, timeout=30).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        driver = "unknown (no nvidia-smi)"
    report.add("env", "driver", driver)


class ModelBuilder:
    """Random-weight Hugging Face directories from CONFIGS and their fxllm artifacts, each built once."""

    def __init__(self, work: Path, device: str):
        self.work, self.device = work, device
        self.work.mkdir(parents=True, exist_ok=True)
        self.seconds: dict[str, float] = {}

    def config(self, name: str):
        from transformers import LlamaConfig

        return LlamaConfig(**CONFIGS[name], max_position_embeddings=CONTEXT, bos_token_id=None, eos_token_id=None,
                           pad_token_id=0)

    def model_dir(self, name: str) -> Path:
        directory = self.work / f"model-{name}"
        if (directory / "config.json").exists():
            return directory
        import torch
        from transformers import AutoModelForCausalLM

        start = time.perf_counter()
        torch.manual_seed(0)
        with torch.device(self.device):  # random init on the GPU: seconds, not a minute, for 1B parameters
            model = AutoModelForCausalLM.from_config(self.config(name), dtype=torch.float32)
        model.save_pretrained(directory)
        byte_tokenizer().save_pretrained(directory)
        self.seconds[f"build {name}"] = time.perf_counter() - start
        return directory

    def artifact(self, name: str, dtype: str, paged: bool) -> Path:
        import fxllm
        from fxllm.compiler.pipeline import DEFAULT_PIPELINE

        output = self.work / f"artifact-{name}-{dtype}{'-paged' if paged else ''}"
        if not (output / "manifest.json").exists():
            start = time.perf_counter()
            passes = ",".join(DEFAULT_PIPELINE) + (",paged" if paged else "")
            fxllm.compile(self.model_dir(name), output, passes=passes, target="torch", dtype=dtype)
            self.seconds[f"compile {output.name}"] = time.perf_counter() - start
        return output

    def hf_model(self, name: str, dtype):
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(self.model_dir(name), dtype=dtype,
                                                    attn_implementation="sdpa").to(self.device).eval()


def byte_tokenizer():
    """A byte-level tokenizer (256 byte tokens, no merges) built offline: the checks feed token ids, and the engine
    and artifacts only need a loadable tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tokenizer = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(sorted(alphabet))}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token=None)


def prompts(count: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    import torch

    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, min(vocab, 32000), (count, length), generator=generator).tolist()


def hf_greedy(model, prompt_ids: list[list[int]], new: int, exact_length: bool = True,
              **generate_options) -> list[list[int]]:
    """transformers' greedy tokens; exact_length: never stop early (the timed runs), else stop at EOS as the
    engine does (parity)."""
    import torch

    ids = torch.tensor(prompt_ids, device=model.device)
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                             min_new_tokens=new if exact_length else None, do_sample=False, pad_token_id=0,
                             **generate_options)
    if out.is_cuda:
        torch.cuda.synchronize()
    return out[:, ids.shape[1]:].tolist()


def parity(report: Report, builder: ModelBuilder, sizes: Sizes, device: str, budget: Budget) -> None:
    """fp32 greedy tokens, fxllm torch target (contiguous and paged) vs transformers, on `device`."""
    import torch

    import fxllm

    name = sizes.parity_model
    rows = [f"{name} fp32 {'paged' if paged else 'contiguous'} vs transformers ({device})" for paged in (False, True)]
    if budget.spent():
        for row in rows:
            report.add("parity", row, budget.SKIPPED)
        return
    model = builder.hf_model(name, torch.float32)
    vocab = model.config.vocab_size
    batch = prompts(4, 16, vocab, seed=1)
    expected = [hf_greedy(model, [p], sizes.parity_tokens, exact_length=False)[0] for p in batch]
    del model
    for paged, row in zip((False, True), rows):
        if budget.spent():
            report.add("parity", row, budget.SKIPPED)
            continue
        try:  # a failing compile or load is this row's result, as in the decode rows; the next rows still run
            engine = fxllm.load(builder.artifact(name, "float32", paged), backend="torch", device=device)
            got = [r.token_ids for r in engine.generate_ids(batch, max_new_tokens=sizes.parity_tokens)]
        except Exception as exc:
            report.add("parity", row, _failure(exc))
            continue
        # the engine also stops at the tokenizer's EOS, which transformers' generation config may not name
        same = sum(g == e or g == e[:len(g)] and g[-1:] == [engine.tokenizer.eos_token_id]
                   for g, e in zip(got, expected))
        first = next((i for g, e in zip(got, expected) for i, (a, b) in enumerate(zip(g, e)) if a != b), None)
        detail = "" if same == len(batch) else f" (first differing token at step {first})"
        report.add("parity", row, f"{same}/{len(batch)} prompts identical over {sizes.parity_tokens} tokens{detail}",
                   identical=same, prompts=len(batch))
        del engine


def decode_row_names(model: str, sizes: Sizes) -> list[str]:
    return [f"{model} bf16 batch {batch} {system}" for batch in (1, sizes.batch) for system in SYSTEMS]


SYSTEMS = ("fxllm torch contiguous", "fxllm torch paged", "transformers eager", "transformers compile+static",
           "fxllm torch contiguous + torch.compile")
EAGER, HF_COMPILED = SYSTEMS[2], SYSTEMS[3]
LATE = SYSTEMS[4:]  # warmed up and timed after the others (its compile may take long): a late start costs only it


def decode(report: Report, builder: ModelBuilder, name: str, sizes: Sizes, device: str, bandwidth: float | None,
           budget: Budget) -> None:
    """bf16 decode speed of every system, interleaved rounds, medians: batch 1 ms/token, batch N tokens/s."""
    import torch

    import fxllm

    def engine_runner(paged: bool, compile: bool = False):
        if budget.spent():
            raise TimeoutError(budget.SKIPPED)
        return fxllm_runner(fxllm.load(builder.artifact(name, "bfloat16", paged), backend="torch", device=device,
                                       max_batch=sizes.batch, torch_compile=compile))

    makers = {SYSTEMS[0]: lambda: engine_runner(False), SYSTEMS[1]: lambda: engine_runner(True)}
    model = builder.hf_model(name, torch.bfloat16)
    makers[EAGER] = lambda: (lambda ids, new: hf_greedy(model, ids, new, disable_compile=True))
    makers[HF_COMPILED] = lambda: hf_static_runner(torch, model, device)
    makers[SYSTEMS[4]] = lambda: engine_runner(False, compile=True)
    runners, failures = {}, {}
    for system, make in makers.items():
        try:
            runners[system] = make()
        except Exception as exc:  # a system that cannot run here is reported, the others still measured
            failures[system] = _failure(exc)
    vocab = model.config.vocab_size
    for batch in (1, sizes.batch):
        ids = prompts(batch, sizes.prompt, vocab, seed=2)
        times: dict[str, list[float]] = {system: [] for system in SYSTEMS}
        failed = dict(failures)
        for group in ([s for s in SYSTEMS if s not in LATE], list(LATE)):
            measure(runners, group, ids, sizes, budget, times, failed)
        eager = statistics.median(times[EAGER]) if times[EAGER] else None
        compiled = statistics.median(times[HF_COMPILED]) if times[HF_COMPILED] else None
        floor = floor_seconds(builder, name, sizes, bandwidth) if batch == 1 else None
        for system in SYSTEMS:
            row = f"{name} bf16 batch {batch} {system}"
            if not times[system]:
                report.add("decode", row, failed.get(system, budget.SKIPPED))
                continue
            step = statistics.median(times[system])
            value = f"{step * 1e3:.2f} ms/token" if batch == 1 else f"{batch / step:,.0f} tokens/s"
            value += f" ({eager / step:.2f}x transformers eager" if eager else " ("
            value += f", {compiled / step:.2f}x transformers compile+static)" if compiled else ")"
            value += f", {step / floor:.1f}x the bandwidth floor" if floor else ""
            report.add("decode", row, value.replace(" ()", ""), seconds_per_step=step, batch=batch)
    report.add("floor", f"{name} batch 1", floor_text(builder, name, sizes, bandwidth))


def measure(runners: dict, systems: list[str], ids: list[list[int]], sizes: Sizes, budget: Budget,
            times: dict[str, list[float]], failed: dict[str, str]) -> None:
    """Warm up `systems` (compiles, CUDA graphs, allocator), then time them in interleaved rounds: per round and
    system, (time of new+1 tokens - time of 1 token) / new, i.e. the decode step without the prefill."""
    systems = [s for s in systems if s in runners and s not in failed]
    for system in systems:
        if budget.spent():
            failed[system] = budget.SKIPPED
            continue
        try:  # the long run first: transformers then reuses its (large enough) static cache for the short one
            runners[system](ids, sizes.new + 1), runners[system](ids, 1)
        except Exception as exc:
            failed[system] = _failure(exc)
    for _ in range(sizes.rounds):
        for system in systems:
            if system in failed or budget.spent():
                continue
            short, long_ = timed(runners[system], ids, 1), timed(runners[system], ids, sizes.new + 1)
            times[system].append((long_ - short) / sizes.new)


def _failure(exc: Exception) -> str:
    if isinstance(exc, TimeoutError) and str(exc) == Budget.SKIPPED:
        return Budget.SKIPPED
    return f"failed: {type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:160]}"


def fxllm_runner(engine):
    def run(ids: list[list[int]], new: int) -> list[list[int]]:
        return [r.token_ids for r in engine.generate_ids(ids, max_new_tokens=new)]

    return run


def hf_static_runner(torch, model, device: str):
    """transformers' documented fast path: a static KV cache and the forward under torch.compile (reduce-overhead:
    CUDA graphs). The compile happens in the warm-up, once per cache length."""
    compiled = torch.compile(model.forward, mode="reduce-overhead" if device == "cuda" else "default",
                             fullgraph=True)

    def run(ids: list[list[int]], new: int) -> list[list[int]]:
        original = model.forward
        model.forward = compiled
        try:
            return hf_greedy(model, ids, new, cache_implementation="static", disable_compile=True)
        finally:
            model.forward = original

    return run


def timed(run, ids, new: int) -> float:
    start = time.perf_counter()
    run(ids, new)
    return time.perf_counter() - start


def copy_bandwidth(torch, device: str, megabytes: int = 1024) -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write), median of 10."""
    source = torch.empty(megabytes * 2**20, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    samples = []
    for _ in range(12):
        torch.cuda.synchronize()
        start = time.perf_counter()
        target.copy_(source)
        torch.cuda.synchronize()
        samples.append(2 * source.numel() / (time.perf_counter() - start))
    return statistics.median(samples[2:])


def bytes_per_token(builder: ModelBuilder, name: str, sizes: Sizes) -> int:
    """bf16 bytes one batch-1 decode step must read: every weight once (the tied embedding as the lm_head; the
    embedding lookup reads one row) and the KV cache at the mean context of the measured decode."""
    config = CONFIGS[name]
    hidden, inter, layers = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    heads, kv_heads, head_dim = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    per_layer = hidden * head_dim * (2 * heads + 2 * kv_heads) + 3 * hidden * inter + 2 * hidden
    weights = layers * per_layer + hidden + config["vocab_size"] * hidden
    context = sizes.prompt + sizes.new // 2
    kv = 2 * layers * kv_heads * head_dim * context
    return 2 * (weights + kv)


def floor_seconds(builder: ModelBuilder, name: str, sizes: Sizes, bandwidth: float | None) -> float | None:
    return bytes_per_token(builder, name, sizes) / bandwidth if bandwidth else None


def floor_text(builder: ModelBuilder, name: str, sizes: Sizes, bandwidth: float | None) -> str:
    size = bytes_per_token(builder, name, sizes)
    if bandwidth is None:
        return f"{size / 1e6:,.1f} MB read per token; bandwidth: {NO_CUDA}"
    return (f"{size / 1e6:,.1f} MB read per token / {bandwidth / 1e12:.2f} TB/s measured copy bandwidth = "
            f"{size / bandwidth * 1e3:.3f} ms/token")


if __name__ == "__main__":
    sys.exit(main())
