"""Checks of a generation request's arguments (and of an engine's load options), shared by the Python API, the CLI
and the HTTP server: every value of the wrong type or out of range becomes an InvalidArgumentError (a
GenerationError) that names the parameter, before any tokenization or model work. Sampling settings are checked
by SamplingParams itself (runtime/request.py); this module adds the request-level rest. The engine core's
add_request checks its prompts with the same functions, so a request gets the same one-line error whichever way it
comes in."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fxllm.errors import GenerationError, InvalidArgumentError
from fxllm.runtime.checks import byte_size, describe, flag, integer, plain_ints_within, short, text
from fxllm.runtime.contract import MAX_SPEC_K
from fxllm.runtime.paged_cache import parse_bytes
from fxllm.runtime.request import ADJUSTMENT_FIELDS, SamplingParams

MAX_THREADS = 1024  # more intra-op threads than this is a typo, not a machine


@dataclass(frozen=True)
class GenerationRequest:
    """One request's checked settings (the prompts are checked separately: they come as text or as token ids).
    `sampling` holds them all but chat, with max_tokens = max_new_tokens (the engine caps it per prompt at the
    room the context leaves)."""

    max_new_tokens: int
    sampling: SamplingParams
    chat: bool = False

    @property
    def stop(self) -> tuple[str, ...]:
        return self.sampling.stop


def check_request(max_new_tokens: Any = 64, temperature: Any = 0.0, top_k: Any = 0, top_p: Any = 1.0,
                  seed: Any = None, stop: Any = None, chat: Any = False, **adjustments: Any) -> GenerationRequest:
    """Engine.generate / generate_ids / stream's keyword arguments → a GenerationRequest. max_new_tokens: an int
    >= 1; stop: None, a string or an iterable of strings; chat: a bool; the rest, and `adjustments` (the
    ADJUSTMENT_FIELDS of runtime/request.py), as SamplingParams. Any other keyword is an InvalidArgumentError naming
    it (not a TypeError naming this function)."""
    name = next((name for name in adjustments if name not in ADJUSTMENT_FIELDS), None)
    if name is not None:
        raise InvalidArgumentError(name, f"{name} is not a generation option (see SamplingParams in "
                                         "fxllm.runtime.request for the options there are)")
    max_new_tokens = integer("max_new_tokens", max_new_tokens, minimum=1)
    sampling = SamplingParams(temperature, top_k, top_p, seed, max_tokens=max_new_tokens, stop=stop, **adjustments)
    return GenerationRequest(max_new_tokens, sampling, flag("chat", chat))


def check_prompt(prompt: Any) -> str:
    """One text prompt: a valid-Unicode str (it may be empty: the engine then reports an empty tokenization)."""
    return text("prompt", prompt)


def check_prompts(prompts: Any) -> tuple[list[str], bool]:
    """generate()'s prompts → (list of prompts, whether a single str was given)."""
    if isinstance(prompts, str):
        return [check_prompt(prompts)], True
    if isinstance(prompts, (bytes, Mapping)) or not isinstance(prompts, Iterable):
        raise InvalidArgumentError("prompts", f"prompts must be a string or a list of strings, got {describe(prompts)}")
    texts = [text(f"prompts[{i}]", prompt, param="prompts") for i, prompt in enumerate(prompts)]
    if not texts:
        raise InvalidArgumentError("prompts", "no prompts given")
    return texts, False


def check_prompt_labels(prompts: Any, rows: int) -> list[str] | None:
    """generate_ids()'s optional `prompts`, the text each row of prompt_ids came from (its results carry it): None,
    or one string per row."""
    if prompts is None:
        return None
    if isinstance(prompts, (str, bytes, Mapping)) or not isinstance(prompts, Iterable):
        raise InvalidArgumentError("prompts", "prompts must be a list of strings, one per row of prompt_ids, got "
                                   f"{describe(prompts)}")
    labels = [text(f"prompts[{i}]", prompt, param="prompts") for i, prompt in enumerate(prompts)]
    if len(labels) != rows:
        raise InvalidArgumentError("prompts", f"prompts holds {len(labels)} strings for {rows} rows of prompt_ids; "
                                   "give one per row")
    return labels


def check_prompt_ids(prompt_ids: Any, vocab_size: int) -> list[list[int]]:
    """generate_ids()'s prompts: a non-empty iterable of token-id sequences, each as check_token_ids."""
    if isinstance(prompt_ids, (str, bytes, Mapping)) or not isinstance(prompt_ids, Iterable):
        raise InvalidArgumentError("prompt_ids",
                                   f"prompt_ids must be a list of token-id lists, got {describe(prompt_ids)}")
    rows = [check_token_ids(f"prompt_ids[{i}]", row, vocab_size, param="prompt_ids")
            for i, row in enumerate(prompt_ids)]
    if not rows:
        raise InvalidArgumentError("prompt_ids", "no prompts given")
    return rows


def check_token_ids(name: str, token_ids: Any, vocab_size: int, *, param: str | None = None) -> list[int]:
    """One token-id sequence (a list, tuple or numpy array): every id an int in [0, vocab_size) — ONNX Runtime
    would index the embedding table with anything else, or fail with its own message. Returns Python ints."""
    param = param or name
    if isinstance(token_ids, (str, bytes, Mapping)) or not isinstance(token_ids, Iterable):
        raise InvalidArgumentError(param, f"{name} must be a list of token ids, got {describe(token_ids)}")
    if plain_ints_within(token_ids, 0, vocab_size - 1):
        return list(token_ids)
    ids = [integer(f"{name}[{j}]", token, param=param) for j, token in enumerate(token_ids)]
    bad = next((j for j, token in enumerate(ids) if not 0 <= token < vocab_size), None)
    if bad is not None:
        raise InvalidArgumentError(param, f"{name}[{bad}] = {ids[bad]} is not a token id of this model (0 to "
                                          f"{vocab_size - 1})")
    return ids


def check_tokenized(ids: list[int], vocab_size: int, param: str = "prompt") -> list[int]:
    """Ids the artifact's own tokenizer gave for a text: one outside the model's vocabulary means the tokenizer does
    not match the model (the compile warns of it), which check_token_ids' message about ids would not say."""
    bad = next((token for token in ids if not 0 <= token < vocab_size), None)
    if bad is not None:
        raise InvalidArgumentError(param, f"the tokenizer gives this text token id {bad}, outside the model's "
                                          f"vocabulary (0 to {vocab_size - 1}): the artifact's tokenizer does not "
                                          "match its model")
    return ids


HEAD_CHARS_PER_TOKEN = 32  # a text of more characters than this per context token is tokenized head first
CUT_TOKENS = 16  # tokens that cutting a text in two can merge away at the cut, with room to spare


def encode_within_context(encode: Callable[[str], list[int]], text: str, max_context: int,
                          param: str = "prompt") -> list[int]:
    """`encode(text)`, except that a text of more than HEAD_CHARS_PER_TOKEN characters per context token is first
    tokenized by its head alone, and refused (InvalidArgumentError) when that head is already past the context: a
    prompt of megabytes then costs a fraction of a second, not seconds of CPU (a cheap way to load a server)."""
    head_chars = HEAD_CHARS_PER_TOKEN * max_context
    if len(text) > head_chars:
        head = len(encode(text[:head_chars]))
        if head > max_context + CUT_TOKENS:
            raise InvalidArgumentError(param, f"the prompt is more than {head - CUT_TOKENS:,} tokens (its first "
                                              f"{head_chars:,} of {len(text):,} characters alone are {head:,}); the "
                                              f"model's context is {max_context:,} tokens")
    return encode(text)


def check_prompt_length(num_prompt_tokens: int, max_tokens: int, max_context: int) -> None:
    """A tokenized prompt is not empty, leaves room for one token in the model's context, and with max_tokens
    generated still fits it."""
    if num_prompt_tokens == 0:
        raise InvalidArgumentError("prompt", "the prompt is empty after tokenization")
    if num_prompt_tokens >= max_context:
        raise InvalidArgumentError("prompt", f"the prompt is {num_prompt_tokens} tokens; the model's context is "
                                             f"{max_context} tokens, which leaves no room to generate")
    if num_prompt_tokens + max_tokens > max_context:
        raise InvalidArgumentError("max_tokens", f"the prompt is {num_prompt_tokens} tokens and max_tokens is "
                                                 f"{short(max_tokens)}, together more than the model's context of "
                                                 f"{max_context} tokens; ask for at most "
                                                 f"{max_context - num_prompt_tokens} tokens")


# -- engine options ---------------------------------------------------------------------------------------------

def check_engine_options(threads: Any = None, kv_blocks: Any = None, kv_cache_memory: Any = None,
                         max_batch: Any = 64, max_tokens_per_step: Any = None, spec_k: Any = None) -> None:
    """Engine.load's numeric options: threads None or 1..MAX_THREADS; kv_blocks None or >= 1; kv_cache_memory
    None, or a positive int of bytes or size string parse_bytes reads ("256MB"), not both; max_batch >= 1;
    max_tokens_per_step None or >= 1; spec_k None or an int in 1..MAX_SPEC_K (checked before a load, which is
    long, where the artifact's own speculator would refuse it after)."""
    if threads is not None:
        integer("threads", threads, minimum=1, maximum=MAX_THREADS)
    if kv_blocks is not None:
        integer("kv_blocks", kv_blocks, minimum=1)
    if kv_cache_memory is not None and (isinstance(kv_cache_memory, bool)
                                        or not isinstance(kv_cache_memory, (int, str))):
        raise InvalidArgumentError("kv_cache_memory", "kv_cache_memory must be a number of bytes or a size such as "
                                                      f"'256MB', got {describe(kv_cache_memory)}")
    if isinstance(kv_cache_memory, str):
        kv_cache_memory = parse_bytes(kv_cache_memory)  # a size string it cannot read is refused here, before loading
    if kv_cache_memory is not None and kv_cache_memory < 1:
        raise InvalidArgumentError("kv_cache_memory", f"kv_cache_memory must be a positive size, got {kv_cache_memory}")
    if kv_blocks is not None and kv_cache_memory is not None:  # one would be ignored without a word
        raise InvalidArgumentError("kv_blocks", "kv_blocks and kv_cache_memory both size the KV cache; give one")
    integer("max_batch", max_batch, minimum=1)
    if max_tokens_per_step is not None:
        integer("max_tokens_per_step", max_tokens_per_step, minimum=1)
    if spec_k is not None and not 1 <= integer("spec_k", spec_k) <= MAX_SPEC_K:
        raise InvalidArgumentError("spec_k", f"spec_k must be between 1 and {MAX_SPEC_K}, got {spec_k}")


def check_load_flags(backend: Any, verify: Any, prefix_caching: Any, spin: Any, torch_compile: Any,
                     int8_activations: Any, unrolled_draft: Any, providers: Any, device: Any,
                     huge_pages: Any = True) -> None:
    """Engine.load's switches are True or False (None too where it means "the artifact's choice"), never a truthy
    string; providers is None or a list of provider names; device and torch_compile belong to backend 'torch'
    (ONNX Runtime picks its device through providers), so they are refused rather than ignored elsewhere."""
    for name, value in (("verify", verify), ("prefix_caching", prefix_caching), ("spin", spin),
                        ("torch_compile", torch_compile), ("huge_pages", huge_pages)):
        flag(name, value)
    for name, value in (("int8_activations", int8_activations), ("unrolled_draft", unrolled_draft)):
        if value is not None:
            flag(name, value)
    if providers is not None and (isinstance(providers, str) or not isinstance(providers, (list, tuple))
                                  or not all(isinstance(p, str) for p in providers)):
        raise InvalidArgumentError("providers", f"providers must be a list of execution provider names such as "
                                                f"['CPUExecutionProvider'], got {describe(providers)}")
    if backend != "torch" and (device != "cpu" or torch_compile):
        option = "device" if device != "cpu" else "torch_compile"
        raise InvalidArgumentError(option, f"{option} applies to backend 'torch' only; backend '{backend}' picks its "
                                           "device through providers (ONNX Runtime) or the engine it was built for")


def check_kv_pool(blocks: int, block_bytes: int, kv_blocks: int | None, kv_cache_memory: int | str | None) -> int:
    """The paged KV pool's size in blocks, refused before anything is allocated when it holds no block or needs
    more memory than this machine has available."""
    if kv_blocks is not None:
        asked = f"kv_blocks={kv_blocks}"
    elif kv_cache_memory is not None:
        asked = f"a KV budget of {kv_cache_memory}"
    else:
        asked = "the default KV budget"
    if blocks < 1:
        raise GenerationError(f"{asked} holds no KV block: one block takes {block_bytes:,} bytes for this model")
    needed = blocks * block_bytes
    available = available_memory()
    if available is not None and needed > available:
        raise GenerationError(f"{asked} needs {byte_size(needed)} for the KV pool ({blocks:,} blocks of "
                              f"{block_bytes:,} bytes), more than the {byte_size(available)} of memory available; ask for fewer blocks "
                              "(kv_blocks, --kv-blocks) or a smaller budget (kv_cache_memory, --kv-cache-memory)")
    return blocks


def available_memory() -> int | None:
    """Bytes this process can still allocate: the kernel's MemAvailable, lowered to the cgroup's remaining limit
    inside a container; None where neither can be read."""
    limits = []
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                limits.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError):
        pass
    try:
        cgroup = Path("/sys/fs/cgroup")
        limit = (cgroup / "memory.max").read_text().strip()
        if limit != "max":
            limits.append(int(limit) - int((cgroup / "memory.current").read_text()))
    except (OSError, ValueError):
        pass
    if not limits and hasattr(os, "sysconf"):
        try:
            limits.append(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
        except (OSError, ValueError):
            pass
    return max(0, min(limits)) if limits else None
