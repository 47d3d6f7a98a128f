"""fxllm's compiler (capture, passes, lowering). It needs the `compile` extra; without it, importing any part of the
compiler raises one MissingDependencyError that names the pip command."""

from fxllm.extras import require_compiler

require_compiler()
