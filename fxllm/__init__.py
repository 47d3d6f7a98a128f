"""fxllm: compile Hugging Face causal LMs through inspectable torch.fx passes to ONNX / TensorRT, and run them."""

from fxllm.errors import FxllmError

__version__ = "0.1.0"


def load(path: str, **engine_options):
    """Load a compiled artifact directory and return a ready-to-generate Engine. A `path` that is not a str or an
    os.PathLike is an InvalidArgumentError naming it."""
    from fxllm.runtime.checks import path as path_argument
    from fxllm.runtime.engine import Engine

    return Engine.load(path_argument("path", path), **engine_options)


def compile(model: str, output: str, **options):  # noqa: A001 - mirrors the CLI verb
    """Compile MODEL (HF directory, .gguf file or built-in name) into an artifact directory; see compiler.compile."""
    from fxllm.compiler.compile import compile_model

    return compile_model(model, output, **options)


__all__ = ["FxllmError", "__version__", "compile", "load"]
