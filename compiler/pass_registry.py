"""The pass registry: every pass is a function Program → Program registered with what it requires and provides."""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fxllm.compiler.program import Program
from fxllm.errors import PipelineError

PassFunction = Callable[..., Program]
OPTION_TYPES = {"bool": bool, "int": int, "float": float, "str": str}


@dataclass(frozen=True)
class PassInfo:
    name: str
    function: PassFunction
    requires: frozenset[str]
    provides: frozenset[str]
    forbids: frozenset[str]
    summary: str
    exact: Callable[[dict[str, Any]], bool]  # with these options, must the pass keep greedy tokens identical?
    option_types: dict[str, type] = field(default_factory=dict)
    option_defaults: dict[str, Any] = field(default_factory=dict)
    check: Callable[..., None] | None = None  # validates the options (keyword arguments) before any work

    def check_options(self, options: dict[str, Any]) -> None:
        """Raise PipelineError for options the pass would refuse, before the compile loads or captures anything."""
        if self.check is not None:
            self.check(**{**self.option_defaults, **options})

    def run(self, program: Program, options: dict[str, Any]) -> Program:
        return self.function(program, **options)


_REGISTRY: dict[str, PassInfo] = {}


def register_pass(
    name: str, requires: tuple[str, ...] = (), provides: tuple[str, ...] = (), forbids: tuple[str, ...] = (),
    exact: bool | Callable[[dict[str, Any]], bool] = True, check: Callable[..., None] | None = None,
) -> Callable[[PassFunction], PassFunction]:
    """Register a pass. Its keyword-only parameters are its options; its docstring's first line is its summary.
    `forbids` names facts that must not hold yet (e.g. a pass that has to run before the KV cache is inserted).
    `exact` says the rewrite preserves the math (the pass manager then fails the compile if greedy tokens change);
    pass a function of the options for passes that are exact only in some modes. `check`, called with every option
    (defaults filled in) when the pipeline is built, refuses bad options before any work."""

    def decorate(function: PassFunction) -> PassFunction:
        signature = inspect.signature(function)
        options = {p.name: p for p in signature.parameters.values() if p.kind is inspect.Parameter.KEYWORD_ONLY}
        _REGISTRY[name] = PassInfo(
            name=name,
            function=function,
            requires=frozenset(requires),
            provides=frozenset(provides),
            forbids=frozenset(forbids),
            summary=(inspect.getdoc(function) or "").splitlines()[0] if function.__doc__ else "",
            exact=exact if callable(exact) else (lambda options, value=exact: value),
            option_types={k: _option_type(p) for k, p in options.items()},
            option_defaults={k: p.default for k, p in options.items() if p.default is not inspect.Parameter.empty},
            check=check,
        )
        return function

    return decorate


def _option_type(parameter: inspect.Parameter) -> type:
    """The option's type from its default, else from its annotation (a string under postponed evaluation)."""
    if parameter.default is not inspect.Parameter.empty and parameter.default is not None:
        return type(parameter.default)
    names = re.findall(r"[A-Za-z_]+", str(parameter.annotation))
    return next((OPTION_TYPES[n] for n in names if n in OPTION_TYPES), str)


def available_passes() -> dict[str, PassInfo]:
    import fxllm.passes  # noqa: F401 - importing the package registers every pass

    return dict(sorted(_REGISTRY.items()))


def get_pass(name: str) -> PassInfo:
    passes = available_passes()
    if name not in passes:
        raise PipelineError(f"unknown pass '{name}'; available passes: {', '.join(passes)}")
    return passes[name]
