"""The optional parts of an fxllm install. `pip install fxllm` is the runtime (load, generate, inspect, eval of an
artifact); the `compile` extra adds what compiling needs, the `serve` extra the HTTP server. Code that needs an extra
checks for it up front, so a missing package is one line naming the pip command instead of an ImportError deep
inside a compile."""

from __future__ import annotations

import importlib.util

from fxllm.errors import MissingDependencyError

# Top-level modules of the `compile` extra in pyproject.toml (tqdm, also there, is optional: no progress bars).
COMPILE_MODULES = ("torch", "transformers", "accelerate", "onnx", "onnxscript", "gguf")
# Top-level modules of the `serve` extra.
SERVE_MODULES = ("fastapi", "uvicorn", "prometheus_client")


def missing_modules(modules: tuple[str, ...]) -> list[str]:
    missing = []
    for name in modules:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):  # a broken or blocked install counts as missing
            found = False
        if not found:
            missing.append(name)
    return missing


def require_compiler() -> None:
    """Raise MissingDependencyError unless the `compile` extra is installed."""
    missing = missing_modules(COMPILE_MODULES)
    if missing:
        raise MissingDependencyError(
            f"this needs fxllm's compiler, which is not installed (missing {', '.join(missing)}); install it with "
            "`pip install 'fxllm[compile]'` (the runtime alone runs compiled artifacts)")


def require_serving() -> None:
    """Raise MissingDependencyError unless the `serve` extra is installed."""
    missing = missing_modules(SERVE_MODULES)
    if missing:
        raise MissingDependencyError(
            f"`fxllm serve` needs fxllm's server, which is not installed (missing {', '.join(missing)}); install it "
            "with `pip install 'fxllm[serve]'`")
