"""Errors a user can act on. The CLI prints them as one line; everything else is a bug and gets a traceback."""


class FxllmError(Exception):
    """Base class: the message alone must tell the user what went wrong and what to do."""


class ModelSourceError(FxllmError):
    """A model path or name that cannot be resolved to a loadable model."""


class UnsupportedModelError(FxllmError):
    """An architecture, config feature or op that fxllm cannot compile."""


class PipelineError(FxllmError):
    """An unknown pass, a bad pass option, or passes in an order that cannot work."""


class ArtifactError(FxllmError):
    """A compiled artifact that is missing, corrupt, or from an incompatible fxllm version."""


class GenerationError(FxllmError):
    """A request the engine cannot serve, e.g. a prompt longer than the context."""


class MissingDependencyError(FxllmError, ImportError):
    """An optional part of fxllm (an extra, e.g. the compiler) is not installed; the message names the pip command."""
