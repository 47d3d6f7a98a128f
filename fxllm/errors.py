"""Errors a user can act on. The CLI prints them as one line (exit status 1); everything else is a bug (exit 2)."""

from __future__ import annotations


class FxllmError(Exception):
    """Base class: the message alone must tell the user what went wrong and what to do. It is one line: runs of
    whitespace, newlines included, become one space, so that a library's multi-line message wrapped into an
    FxllmError cannot break the one-line contract of the CLI, the Python API and (later) the HTTP error body."""

    def __init__(self, message: object = "", *args: object):
        super().__init__(" ".join(str(message).split()), *args)


class ModelSourceError(FxllmError):
    """A model path or name that cannot be resolved to a loadable model."""


class UnsupportedModelError(FxllmError):
    """An architecture, config feature or op that fxllm cannot compile."""


class PipelineError(FxllmError):
    """An unknown pass, a bad pass option, or passes in an order that cannot work."""


class ArtifactError(FxllmError):
    """A compiled artifact that is missing, corrupt, or from an incompatible fxllm version; or an output directory
    the compiler must not replace."""


class GenerationError(FxllmError):
    """A request the engine cannot serve, e.g. a prompt longer than the context."""


class MissingDependencyError(FxllmError, ImportError):
    """An optional part of fxllm (an extra, e.g. the compiler) is not installed; the message names the pip command."""


class InvalidArgumentError(GenerationError):
    """A generation or engine argument of the wrong type or out of range. `param` names the argument as the Python
    API spells it (e.g. "max_new_tokens"): what an HTTP error body reports as its "param"."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param

    def __reduce__(self):  # pickle (e.g. across processes) with both arguments, not just the message
        return type(self), (self.param, str(self))


class EvaluationError(FxllmError):
    """`fxllm eval` input that cannot be scored: a text file that is missing, a directory or not UTF-8, or a window
    length / token limit out of range."""


class UsageError(FxllmError):
    """A command line argparse cannot parse (unknown flag, missing value, a value of the wrong type)."""


class Interrupted(KeyboardInterrupt):
    """A compile stopped by SIGINT, SIGTERM or SIGHUP after cleaning up its staging directory. A KeyboardInterrupt
    (not an FxllmError) so that no library's `except Exception` swallows it on the way out; `signum` is the signal."""

    def __init__(self, signum: int):
        import signal

        super().__init__(f"interrupted by {signal.Signals(signum).name}")
        self.signum = signum
