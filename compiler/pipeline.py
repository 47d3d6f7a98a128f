"""A pipeline: an ordered list of passes with options, validated before any work, run with lint and drift checks."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fxllm.compiler.pass_registry import PassInfo, get_pass
from fxllm.errors import PipelineError
from fxllm.runtime.checks import short

DEFAULT_PIPELINE = ("cleanup", "gqa", "fuse-projections", "select-logits", "kv-cache")
CAPTURE_FACTS = frozenset({"captured", "fxllm-attention"})


@dataclass
class PipelineStep:
    info: PassInfo
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.info.name


def parse_pipeline(text: str | list[str] | tuple[str, ...] | None) -> list[tuple[str, dict[str, Any]]]:
    """'cleanup,kv-cache,name:key=value;key2=value2' → [(name, {option: value-as-text}), ...]."""
    if text is None:
        return [(name, {}) for name in DEFAULT_PIPELINE]
    items = text.split(",") if isinstance(text, str) else list(text)
    odd = [item for item in items if not isinstance(item, str)]
    if odd:
        raise PipelineError(f"passes must be pass names (strings), got {type(odd[0]).__name__} {odd[0]!r}")
    if not any(item.strip() for item in items):
        raise PipelineError("the pass list is empty")
    steps = []
    for position, item in enumerate((i.strip() for i in items), 1):
        if not item:  # 'a,,b' or 'a,b,': a pass name lost in editing, not a pass to skip
            raise PipelineError(f"the pass list {short(','.join(items))} has an empty entry at position {position}")
        name, _, option_text = item.partition(":")
        options = {}
        for pair in filter(None, option_text.split(";")):
            key, eq, value = pair.partition("=")
            if not eq:
                raise PipelineError(f"pass option '{pair}' of '{name}' is not of the form key=value")
            key = key.strip().replace("-", "_")
            if key in options:
                raise PipelineError(f"pass option '{key}' of '{name}' is given twice")
            options[key] = value.strip()
        steps.append((name.strip(), options))
    return steps


QUANT_OPTIONS = ("group_size", "calib", "lm_head", "embedding", "zero_point")  # quantize options a caller may set
# how `fxllm compile` spells each (zero_point has no flag: quant_options of fxllm.compile)
QUANT_FLAGS = {"method": "--quant", "group_size": "--group-size", "calib": "--calib", "lm_head": "--quant-lm-head",
               "embedding": "--quant-embedding", "zero_point": "zero_point"}


def place_quantization(passes: str | list[str] | None, pass_options: dict[str, dict[str, Any]] | None,
                       quant: str | None = None, quant_options: dict[str, Any] | None = None, gguf: bool = False,
                       requantize: bool = False) -> tuple[str | list[str] | None, dict[str, dict[str, Any]]]:
    """Where quantization goes in a pipeline (fxllm.compile(quant=...) and `fxllm compile --quant` alike): the
    `quantize` pass with method `quant` and `quant_options`, placed before kv-cache when the default pipeline is
    used. A GGUF source keeps its own quantized blocks (method `gguf`, no re-rounding) unless `requantize`, which
    loads it as float like any other model (then `quant` re-quantizes it). Options for that quantize pass
    (`pass_options["quantize"]`, `--pass-option quantize.KEY=VALUE`) would otherwise be overridden or ignored
    there, so they are refused: on a GGUF kept as blocks (only method=gguf is accepted), and where `quant` or
    `quant_options` set the same key. → (passes, pass options)."""
    _check_option_tables(pass_options, quant_options)
    options = {name: dict(values) for name, values in (pass_options or {}).items()}
    quant_options = {key: value for key, value in (quant_options or {}).items() if value is not None}
    unknown = set(quant_options) - set(QUANT_OPTIONS)
    if unknown:
        raise PipelineError(f"unknown quantization option(s) {', '.join(sorted(unknown))} "
                            f"(available: {', '.join(QUANT_OPTIONS)})")
    if quant is not None and (not isinstance(quant, str) or not quant.strip()):
        raise PipelineError(f"--quant needs a method (int8, int4-rtn, int4-gptq, int4-awq), got {quant!r}")
    if quant == "int8" and quant_options.get("group_size") is not None:
        raise PipelineError("--group-size applies to the int4 methods; int8 has one scale per output channel")
    if quant_options and not quant:
        raise PipelineError(f"quantization option '{next(iter(quant_options))}' needs a method (--quant METHOD)")
    if quant_options.get("calib") and quant not in ("int4-gptq", "int4-awq"):
        raise PipelineError("--calib applies to the calibrated methods int4-gptq and int4-awq")
    if quant_options.get("zero_point") in (True, "true", "1", "yes", "on") and quant == "int8":
        raise PipelineError("zero_point applies to the int4 methods (int4-rtn, int4-gptq, int4-awq); int8 is symmetric "
                            "per output channel")
    if requantize and not gguf:
        raise PipelineError("--requantize applies to GGUF sources only (their quantized blocks are kept otherwise)")
    if quant and gguf and not requantize:
        raise PipelineError(f"this GGUF's own quantized blocks are kept exactly; add --requantize to load it as float "
                            f"and quantize it again with {quant}")
    if gguf and not requantize and passes is None:
        _check_kept_gguf_options(options.get("quantize", {}))
        quant = "gguf"
    if gguf and not requantize and passes is not None:
        _check_no_requantizing_pass(passes, options.get("quantize", {}))
    if quant:
        _check_no_double_options(options.get("quantize", {}), {**quant_options, "method": quant})
        options.setdefault("quantize", {}).update({**quant_options, "method": quant})
        if passes is None:
            passes = ",".join(p for p in DEFAULT_PIPELINE if p != "kv-cache") + ",quantize,kv-cache"
    return passes, options


def _check_no_requantizing_pass(passes: str | list[str], quantize_options: dict[str, Any]) -> None:
    """A GGUF's blocks are kept exactly unless --requantize: a quantize pass of another method in an explicit pass
    list re-rounded them as --quant would, which is refused (a bare `quantize` made a Q4_0 file int8)."""
    for name, inline in parse_pipeline(passes):
        method = inline.get("method", quantize_options.get("method"))
        if name == "quantize" and method != "gguf":
            shown = f"method {method}" if method else "its default method"
            raise PipelineError(f"this GGUF's own quantized blocks are kept exactly, but --passes quantizes them again "
                                f"({shown}); give quantize:method=gguf to keep them, or add --requantize to load the "
                                "file as float and quantize it again")


def _check_option_tables(pass_options: Any, quant_options: Any) -> None:
    """pass_options must map pass names to {option: value} dicts and quant_options option names to values (or be
    None); anything else was a TypeError or AttributeError from deep in the pipeline's setup."""
    def is_table(value: Any) -> bool:
        return isinstance(value, dict) and all(isinstance(key, str) for key in value)

    if pass_options is not None and not (is_table(pass_options) and all(map(is_table, pass_options.values()))):
        raise PipelineError(f"pass_options must map pass names to {{option: value}} dicts, e.g. {{'gqa': "
                            f"{{'kv_heads': 2}}}}, got {short(pass_options)}")
    if quant_options is not None and not is_table(quant_options):
        raise PipelineError(f"quant_options must map option names to values, e.g. {{'group_size': 64}}, got "
                            f"{short(quant_options)}")


def _check_kept_gguf_options(options: dict[str, Any]) -> None:
    """A GGUF whose blocks are kept runs quantize with method gguf, which takes no other option: refuse any."""
    for key, value in options.items():
        if key != "method" or value != "gguf":
            raise PipelineError(f"--pass-option quantize.{key}={value} does not apply: this GGUF's own quantized "
                                "blocks are kept exactly (method gguf); add --requantize --quant METHOD to load it as "
                                "float and quantize it again")


def _check_no_double_options(pass_options: dict[str, Any], placed: dict[str, Any]) -> None:
    """--quant and its flags set quantize's options; the same option in --pass-option as well would be silently
    overridden, so it is refused."""
    for key in sorted(pass_options.keys() & placed.keys()):
        if key == "method" and placed[key] == "gguf":
            continue  # the kept GGUF's own method, given again: nothing is overridden
        raise PipelineError(f"quantize option '{key}' is given twice ({QUANT_FLAGS[key]} {placed[key]} and "
                            f"--pass-option quantize.{key}={pass_options[key]}); give it once")


def place_dtype(passes: str | list[str] | None, dtype: str) -> str | list[str] | None:
    """Half precision (fxllm.compile(dtype=...) and `fxllm compile --dtype` alike) is the `dtype` pass, run last
    (it converts the cache signature kv-cache and paged created). float32 leaves the pipeline as it is."""
    from fxllm.runtime.contract import FLOAT_DTYPES

    if dtype not in FLOAT_DTYPES:
        raise PipelineError(f"unknown dtype '{dtype}' (available: {', '.join(FLOAT_DTYPES)})")
    if dtype == "float32":
        return passes
    items = list(parse_pipeline(passes))
    if any(name == "dtype" for name, _ in items):
        raise PipelineError("--dtype and a 'dtype' pass in --passes both set the precision; give only one")
    return [f"{name}:{';'.join(f'{k}={v}' for k, v in options.items())}" if options else name
            for name, options in items] + [f"dtype:to={dtype}"]


def check_dtype(steps: list[PipelineStep], target: str, gguf: bool = False) -> None:
    """The precision a pipeline compiles to must be one its target runs, the `dtype` pass must come last, and
    quantized graphs stay float32 — all checked before any work."""
    from fxllm.runtime.contract import TARGET_DTYPES

    names = [step.name for step in steps]
    dtype = "float32"
    if "dtype" in names:
        step = steps[names.index("dtype")]
        dtype = step.options.get("to", step.info.option_defaults.get("to"))
        if names[-1] != "dtype":
            raise PipelineError(f"pass 'dtype' must be the last pass (order: {' → '.join(names)}): later passes "
                                "would add float32 inputs and outputs to a half-precision graph")
        if "quantize" in names:
            hint = " (GGUF sources keep their quantized blocks by default: add --requantize)" if gguf else ""
            raise PipelineError(f"quantized artifacts are float32 only for now: --dtype {dtype} cannot be combined "
                                f"with the quantize pass{hint}")
    if dtype not in TARGET_DTYPES[target]:
        raise PipelineError(f"target '{target}' does not run {dtype} (it runs {', '.join(TARGET_DTYPES[target])}); "
                            "compile half precision with --target torch or --target tensorrt")


def build_pipeline(
    requested: list[tuple[str, dict[str, Any]]], extra_options: dict[str, dict[str, Any]] | None = None
) -> list[PipelineStep]:
    """Resolve names and options and check the order against requires/provides/forbids — before any work."""
    extra_options = extra_options or {}
    for name, options in requested:  # an option set in the pass list and otherwise too: one value would be dropped
        extra = extra_options.get(name, {})
        clash = next((key for key in sorted(options.keys() & extra.keys()) if str(options[key]) != str(extra[key])),
                     None)
        if clash is not None:
            raise PipelineError(f"pass '{name}' option '{clash}' is given two values: {name}:{clash}={options[clash]} "
                                f"in the pass list and {extra[clash]} besides it (--pass-option, --kv-heads, --quant "
                                "and its flags); give it once")
    steps = [PipelineStep(get_pass(name), _typed_options(get_pass(name), {**options, **extra_options.get(name, {})}))
             for name, options in requested]
    for name in extra_options:
        if name not in {s.name for s in steps}:
            raise PipelineError(f"options were given for pass '{name}', which is not in the pipeline")
    for step in steps:
        step.info.check_options(step.options)
    facts = set(CAPTURE_FACTS)
    seen: list[str] = []
    for step in steps:
        missing = step.info.requires - facts
        if missing:
            providers = _providers(missing)
            hint = f"; put {' / '.join(providers)} before it" if providers else ""
            raise PipelineError(
                f"pass '{step.name}' requires {', '.join(sorted(missing))}, which no earlier pass provides "
                f"(order: {' → '.join(seen + [step.name])}){hint}"
            )
        clashing = step.info.forbids & facts
        if clashing and step.name in seen:  # its own earlier run provided the fact: say it is listed twice
            raise PipelineError(f"pass '{step.name}' is listed twice (order: {' → '.join(seen + [step.name])}); "
                                "it runs once")
        if clashing:
            raise PipelineError(
                f"pass '{step.name}' must run before anything that provides {', '.join(sorted(clashing))} "
                f"(order: {' → '.join(seen + [step.name])})"
            )
        facts |= step.info.provides
        seen.append(step.name)
    return steps


def _providers(facts: set[str]) -> list[str]:
    from fxllm.compiler.pass_registry import available_passes

    return [name for name, info in available_passes().items() if info.provides & facts]


def _typed_options(info: PassInfo, options: dict[str, Any]) -> dict[str, Any]:
    typed = {}
    for key, value in options.items():
        if key not in info.option_types:
            known = ", ".join(info.option_types) or "none"
            raise PipelineError(f"pass '{info.name}' has no option '{key}' (its options: {known})")
        kind = info.option_types[key]
        try:
            typed[key] = None if value is None and info.option_defaults.get(key, 0) is None else _convert(value, kind)
        except ValueError as exc:
            raise PipelineError(f"pass '{info.name}' option '{key}': {exc}") from exc
    return typed


def _convert(value: Any, kind: type) -> Any:
    """A command-line string converted to the option's type; any other value checked against it (a bool is not an
    int, an int is a float)."""
    if not isinstance(value, str) or kind is str:
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            return float(value)
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise ValueError(f"expected {kind.__name__}, got {type(value).__name__} {value!r}")
        return value
    if kind is bool:
        if value.lower() in ("1", "true", "yes", "on"):
            return True
        if value.lower() in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"expected true/false, got '{value}'")
    try:
        return kind(value)
    except ValueError:
        raise ValueError(f"expected {kind.__name__}, got '{value}'") from None
