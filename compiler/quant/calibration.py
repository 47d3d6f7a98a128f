"""Calibration for data-aware quantization: token samples from a text, and a walk through the graph that hands
each linear layer its real inputs, in graph order, after the layers before it were already quantized.

The walk is a torch.fx.Interpreter that pauses at every target linear: `visit(group, x, need_outputs)` receives the
linears that read the same input x and returns their outputs (computed with the quantized weights), which is what
the rest of the graph then sees. It stops once the last group is quantized, without computing that group's outputs
(for a quantized lm_head these would be [tokens × vocabulary] logits nobody needs).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import torch

from fxllm.compiler.interface import step_inputs
from fxllm.compiler.program import Program
from fxllm.datasets import WHOLE_TEXT_CHARS
from fxllm.errors import PipelineError

Node = torch.fx.Node
Visit = Callable[[list[Node], torch.Tensor, bool], dict[Node, torch.Tensor]]  # (group, x, outputs needed)


SLICE_CHARS_PER_TOKEN = 8  # a longer text's slices: this many characters for each token a window needs, doubled
SLICE_TRIES = 4  # ... up to this many times where a slice holds fewer tokens (then the text is tokenized whole)


class TooFewTokens(Exception):
    """The text holds fewer tokens than the windows need; `tokens`: how many it holds."""

    def __init__(self, tokens: int):
        super().__init__(tokens)
        self.tokens = tokens


def spread_windows(tokenizer, text: str, count: int, window: int, needed: int) -> list[list[int]]:
    """`count` windows of `window` token ids at evenly spread places of the text, which must hold `needed` tokens
    (else TooFewTokens). A text of up to WHOLE_TEXT_CHARS characters is tokenized whole; a longer one only in
    `count` slices at evenly spread offsets, each window starting at its slice's second token and ending before its
    last (either may be a cut word's), so a corpus of any size costs what its windows do."""
    if len(text) > WHOLE_TEXT_CHARS:
        windows = _windows_from_slices(tokenizer, text, count, window)
        if windows is not None:
            return windows
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) < needed:
        raise TooFewTokens(len(ids))
    starts = torch.linspace(0, len(ids) - window, count).long().tolist()
    return [ids[s:s + window] for s in starts]


def _windows_from_slices(tokenizer, text: str, count: int, window: int) -> list[list[int]] | None:
    """spread_windows for a long text, from slices; None where a slice holds too few tokens however long it is."""
    span = window * SLICE_CHARS_PER_TOKEN
    for _ in range(SLICE_TRIES):
        if span * count > len(text):
            return None
        starts = torch.linspace(0, len(text) - span, count).long().tolist()
        pieces = [tokenizer(text[s:s + span], add_special_tokens=False)["input_ids"] for s in starts]
        if all(len(ids) >= window + 2 for ids in pieces):  # neither end's token, which may be a cut word's
            return [ids[1:window + 1] for ids in pieces]
        span *= 2
    return None


def calibration_tokens(tokenizer, text: str, samples: int, seq_len: int, source: str) -> torch.Tensor:
    """`samples` windows of `seq_len` tokens, evenly spread over the text: [samples, seq_len]."""
    check_sample_shape(samples, seq_len)
    if not text.strip():
        raise PipelineError(f"quantize: the calibration text '{source}' is empty")
    needed = samples * seq_len
    try:
        windows = spread_windows(tokenizer, text, samples, seq_len, needed)
    except TooFewTokens as short:
        raise PipelineError(
            f"quantize: the calibration text '{source}' has {short.tokens} tokens; {samples} samples of {seq_len} "
            f"tokens need {needed}; give a longer text or fewer/shorter samples (--pass-option quantize.samples=N, "
            f"quantize.seq_len=N)") from None
    return torch.tensor(windows, dtype=torch.long)


def check_sample_shape(samples: int, seq_len: int) -> None:
    """The quantize pass's calibration shape: at least one sample of at least two tokens."""
    if samples < 1 or seq_len < 2:
        raise PipelineError(f"quantize: need samples >= 1 and seq_len >= 2, got {samples} and {seq_len}")


def check_calibration_source(path: str, user: str = "quantize") -> None:
    """Refuse a calibration source that is neither a named dataset nor a readable file, before any work; `user`
    (the quantize pass, the int8 KV cache) begins the message."""
    from fxllm.datasets import dataset_names

    if path in dataset_names() and not Path(path).exists():
        return
    if not str(path).strip():  # Path("") is the working directory: "'' is a directory"
        raise PipelineError(f"{user}: the calibration text path is empty (give a UTF-8 text file or one of "
                            f"{', '.join(dataset_names())})")
    file = Path(path)
    if not file.is_file() or not os.access(file, os.R_OK):
        problem = "is a directory" if file.is_dir() else "is not readable" if file.exists() else "does not exist"
        raise PipelineError(f"{user}: the calibration text '{path}' {problem} (give a UTF-8 text file or one of "
                            f"{', '.join(dataset_names())})")
    if not _decode(file.read_bytes(), path, user).strip():  # before the model loads: refused at once, not after it
        raise PipelineError(f"{user}: the calibration text '{path}' is empty")


def read_calibration_text(path: str, user: str = "quantize") -> tuple[str, str]:
    """(text, source name) from a file path, or from a named public-domain dataset ('shakespeare'); `user` begins
    an error's message."""
    from fxllm.datasets import dataset_names, dataset_text

    if path in dataset_names() and not Path(path).exists():
        return dataset_text(path), path
    try:
        return _decode(Path(path).read_bytes(), path, user), path
    except OSError as exc:
        raise PipelineError(f"{user}: cannot read the calibration text '{path}': {exc}") from exc


def _decode(data: bytes, path: str, user: str) -> str:
    from fxllm.datasets import utf8_text

    try:
        return utf8_text(data)
    except UnicodeDecodeError as exc:
        raise PipelineError(f"{user}: the calibration text '{path}' is not UTF-8 text (byte "
                            f"0x{exc.object[exc.start]:02x} at offset {exc.start}); calibrating on it would fit the "
                            "quantization to noise") from None


class _Stop(Exception):
    pass


class _LinearWalk(torch.fx.Interpreter):
    def __init__(self, program: Program, targets: list[Node], visit: Visit, on_done: Callable[[int], None]):
        super().__init__(program.graph_module, garbage_collect_values=True)
        self.remaining = set(targets)
        self.targets = set(targets)
        self.visit = visit
        self.on_done = on_done
        self.ready: dict[Node, torch.Tensor] = {}

    def run_node(self, node: Node):
        if node not in self.targets:
            return super().run_node(node)
        if node not in self.ready:
            x = self.env[node.args[0]]
            group = [t for t in self.remaining if t.args[0] is node.args[0]]
            group.sort(key=lambda t: t.name)
            last = len(group) == len(self.remaining)  # nothing after it is needed (e.g. a quantized lm_head's logits)
            self.ready.update(self.visit(group, x, not last))
            self.on_done(len(group))
            if last:
                raise _Stop
        self.remaining.discard(node)
        return self.ready.pop(node)


def walk_linears(program: Program, tokens: torch.Tensor, targets: list[Node], visit: Visit,
                 on_done: Callable[[int], None] = lambda n: None) -> None:
    """Run the calibration tokens [samples, seq_len] through the graph as one batch (visit sees every sample's
    activations at once, as GPTQ's Hessian and AWQ's search need), calling visit() at each group of targets."""
    inputs = step_inputs(program, tokens, {})
    with torch.no_grad():
        try:
            _LinearWalk(program, targets, visit, on_done).run(*inputs)
        except _Stop:
            return
    raise PipelineError("quantize: the calibration walk ended before reaching every linear layer")
