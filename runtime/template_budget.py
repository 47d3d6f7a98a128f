"""Bounds on what an untrusted chat template may cost: time and the size of what it builds.

jinja2's sandbox keeps a template away from Python internals but not from work without end: nested loops over
`range(100000)` (the sandbox's own cap per range) run for hours, and `'a' * 300000000` allocates 300 MB in one
step. A template renders for every request of a server, so either would hang or exhaust it.

- `BudgetedSandbox` refuses, before building it, any value past MAX_BUILT_ITEMS characters or items that the template
  would build with an operator (`*`, `+`, `%`, `~`), a str / bytes / int method (`center`, `ljust`, `rjust`,
  `zfill`, `expandtabs`, `replace`, `join`, `format`, `format_map`, `translate`, `encode`, `hex`, case changes,
  `to_bytes`), a growing filter (`center`, `indent`, `join`, `replace`, `format`, `wordwrap`, `truncate`, `string`,
  `pprint`, `escape`, `urlencode`, `urlize`, `xmlattr`, `sum`, `batch`, `slice`, case changes), `lipsum`, by
  printing a value (`{{ x }}`: a container's text is estimated before `str()` builds it) or by rendering (the
  output, and each `{% set %}` / macro / filter block, is joined only if it fits); an integer power beyond
  2**MAX_POWER_BITS is refused too. The predictions are runtime/template_sizes.py's.
- `render_within(template, seconds, ...)` stops a render that runs longer than `seconds`: a trace function checks
  the clock on each line of the template's own frames and on each Python call made while rendering (C code, such
  as one `str.join`, is not interrupted: the size bounds keep each such call small).
"""

from __future__ import annotations

import functools
import io
import pprint
import sys
import time
from collections.abc import Callable, Iterable
from typing import Any

import jinja2
import jinja2.compiler
import jinja2.filters
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment, SandboxedEscapeFormatter, SandboxedFormatter, SecurityError
from markupsafe import Markup

from fxllm.runtime.template_sizes import (FILTER_SIZES, MAX_BUILT_ITEMS, check_size, escaped_size, field_size,
                                          lipsum_size, method_size, percent_size, repr_size, spec_numbers, text_size)

MAX_POWER_BITS = 4096
TEMPLATE_FILENAME = "<template>"  # what jinja2 compiles a template from a string under


class RenderTimeout(Exception):
    """A template ran past its time budget."""


class _BudgetedFormatter(SandboxedFormatter):
    """str.format / format_map in the sandbox, refusing a result past the budget before each field is built."""

    def __init__(self, environment: jinja2.Environment, template: str, **kwargs: Any):
        super().__init__(environment, **kwargs)
        self.built = len(template)  # the literal text, at most

    def convert_field(self, value: Any, conversion: str | None) -> Any:
        if conversion in ("r", "a"):
            check_size(self.built + repr_size(value), "format()")
        return super().convert_field(value, conversion)

    def format_field(self, value: Any, format_spec: str) -> Any:
        self.built += field_size(value) + spec_numbers(format_spec)
        check_size(self.built, "format()")
        return super().format_field(value, format_spec)


class _BudgetedEscapeFormatter(_BudgetedFormatter, SandboxedEscapeFormatter):
    def format_field(self, value: Any, format_spec: str) -> Any:
        self.built += 5 * field_size(value)  # the field is escaped
        return super().format_field(value, format_spec)


# --- the environment -------------------------------------------------------------------------------------------

class _BudgetedCodeGenerator(jinja2.compiler.CodeGenerator):
    """jinja2's code generator, with `a ~ b` checked (the parts' total text must fit before they are joined) and
    block buffers that refuse to grow past the budget."""

    def buffer(self, frame: jinja2.compiler.Frame) -> None:
        frame.buffer = self.temporary_identifier()
        self.writeline(f"{frame.buffer} = environment.output_buffer()")

    @jinja2.compiler.optimizeconst
    def visit_Concat(self, node: jinja2.nodes.Concat, frame: jinja2.compiler.Frame) -> None:
        if frame.eval_ctx.volatile:
            join = "(markup_join if context.eval_ctx.volatile else str_join)"
        elif frame.eval_ctx.autoescape:
            join = "markup_join"
        else:
            join = "str_join"
        self.write(f"{join}(environment.check_concat((")
        for argument in node.nodes:
            self.visit(argument, frame)
            self.write(", ")
        self.write(")))")


class BudgetedSandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox, refusing any value the template would build past MAX_BUILT_ITEMS (see the module)."""

    intercepted_binops = frozenset(["*", "+", "**", "%"])
    code_generator_class = _BudgetedCodeGenerator

    def __init__(self, **options: Any):
        super().__init__(finalize=_finalize, **options)
        for name, predict in FILTER_SIZES.items():
            self.filters[name] = _predicted(self.filters[name], name, predict)
        self.filters.update(join=_join, sum=_sum, pprint=_pprint)
        self.globals["lipsum"] = _predicted(self.globals["lipsum"], "lipsum", lipsum_size)

    def call_binop(self, context: jinja2.runtime.Context, operator: str, left: Any, right: Any) -> Any:
        if operator == "*":
            sequence, count = (left, right) if _sized(left) else (right, left)
            if _sized(sequence) and isinstance(count, int):
                check_size(len(sequence) * count, "'*'")
        elif operator == "+" and _sized(left) and _sized(right):
            check_size(len(left) + len(right), "'+'")
        elif operator == "%" and isinstance(left, (str, bytes)):  # Markup escapes the values it formats
            check_size(percent_size(left, right) * (6 if isinstance(left, Markup) else 1), "'%'")
        elif operator == "**" and isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and \
                right * max(abs(left).bit_length(), 1) > MAX_POWER_BITS:
            raise SecurityError(f"the template raises {left} to the power {right} (at most {MAX_POWER_BITS} bits)")
        return super().call_binop(context, operator, left, right)

    def call(self, context: jinja2.runtime.Context, obj: Any, /, *args: Any, **kwargs: Any) -> Any:
        """A call from the template: a growing str / bytes / int method is refused when its result would not fit."""
        owner, name = getattr(obj, "__self__", None), getattr(obj, "__name__", None)
        if owner is not None and isinstance(name, str):
            if name == "join" and isinstance(owner, (str, bytes)) and len(args) == 1 and not kwargs:
                items = list(args[0])
                measure = escaped_size if isinstance(owner, Markup) else len  # Markup.join escapes the items
                check_size(sum(measure(item) if isinstance(item, (str, bytes)) else 0 for item in items)
                           + max(len(items) - 1, 0) * len(owner), "join()")
                args = (items,)
            else:
                predicted = method_size(owner, name, args, kwargs)
                if predicted is not None:
                    # Markup's methods escape their arguments: up to 5 more characters for each one
                    check_size(predicted * (6 if isinstance(owner, Markup) else 1), f"{name}()")
        return super().call(context, obj, *args, **kwargs)

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        """str.format / format_map through a formatter that checks each field's size (jinja2's own, plus that)."""
        wrapped = super().wrap_str_format(value)
        if wrapped is None:
            return None
        template, is_format_map = value.__self__, value.__name__ == "format_map"

        def format_within_budget(*args: Any, **kwargs: Any) -> str:
            if is_format_map:
                if kwargs or len(args) != 1:
                    raise TypeError("format_map() takes exactly one positional argument")
                args, kwargs = (), args[0]
            formatter = (_BudgetedEscapeFormatter(self, template, escape=template.escape)
                         if isinstance(template, Markup) else _BudgetedFormatter(self, template))
            return type(template)(formatter.vformat(template, args, kwargs))

        return functools.update_wrapper(format_within_budget, value)

    def check_concat(self, parts: tuple) -> tuple:
        """`parts` of a `~` expression, if their joined text fits (escaped, when one of them is markup)."""
        if any(hasattr(part, "__html__") for part in parts):
            check_size(sum(escaped_size(part) for part in parts), "'~'")
        else:
            check_size(sum(text_size(part) for part in parts), "'~'")
        return parts

    def concat(self, pieces: Iterable[str]) -> str:  # type: ignore[override]
        """The render's output (or a block's), joined if it fits; refused at the first piece that does not."""
        kept, total = [], 0
        for piece in pieces:
            total += len(piece)
            check_size(total, "its output")
            kept.append(piece)
        return "".join(kept)

    @staticmethod
    def output_buffer() -> _OutputBuffer:
        """The list a block ({% set %}, a macro, a filter or call block) collects its output in."""
        return _OutputBuffer()


class _OutputBuffer(list):
    """A block's output pieces, refusing to hold more than MAX_BUILT_ITEMS characters (the render's own output is
    a generator, which `BudgetedSandbox.concat` counts as it comes)."""

    size = 0

    def append(self, piece: str) -> None:
        self._grow(len(piece))
        super().append(piece)

    def extend(self, pieces: Iterable[str]) -> None:
        pieces = tuple(pieces)
        self._grow(sum(len(piece) for piece in pieces))
        super().extend(pieces)

    def _grow(self, size: int) -> None:
        self.size += size
        check_size(self.size, "its output")


def _sized(value: Any) -> bool:
    return isinstance(value, (str, list, tuple))


@jinja2.pass_eval_context
def _finalize(eval_ctx: jinja2.nodes.EvalContext, value: Any) -> Any:
    """Each `{{ value }}`: its text (escaped, under autoescape) must fit before str() builds it."""
    if not isinstance(value, str) or eval_ctx.autoescape:
        check_size(escaped_size(value) if eval_ctx.autoescape else text_size(value), "'{{ }}'")
    return value


# --- filters ---------------------------------------------------------------------------------------------------

def _predicted(function: Callable, name: str, predict: Callable[..., int]) -> Callable:
    """`function` (a filter or global), refusing a call whose `predict(*arguments)` exceeds the budget; jinja2's
    pass_context / pass_eval_context / pass_environment first argument is not passed to `predict`."""
    passes = jinja2.utils._PassArg.from_obj(function) is not None

    @functools.wraps(function)  # keeps jinja2's pass_* marker
    def bounded(*args: Any, **kwargs: Any) -> Any:
        check_size(predict(*args[passes:], **kwargs), f"'{name}'")
        return function(*args, **kwargs)

    return bounded


@jinja2.pass_eval_context
def _join(eval_ctx: jinja2.nodes.EvalContext, value: Iterable[Any], d: str = "",
          attribute: str | int | None = None) -> str:
    """jinja2's join, refused when the items' text and the separators would not fit."""
    if attribute is not None:
        value = map(jinja2.filters.make_attrgetter(eval_ctx.environment, attribute), value)
    items = list(value)
    measure = escaped_size if eval_ctx.autoescape else text_size
    total = max(len(items) - 1, 0) * measure(d)
    for item in items:
        total += measure(item)
        if total > MAX_BUILT_ITEMS:
            break
    check_size(total, "'join'")
    return jinja2.filters.sync_do_join(eval_ctx, items, d)


@jinja2.pass_environment
def _sum(environment: jinja2.Environment, iterable: Iterable[Any], attribute: str | int | None = None,
         start: Any = 0) -> Any:
    """jinja2's sum, refused when adding lists or strings would build a value past the budget."""
    if attribute is not None:
        iterable = map(jinja2.filters.make_attrgetter(environment, attribute), iterable)
    items = list(iterable)
    if _sized(start):
        check_size(len(start) + sum(len(item) if _sized(item) else 0 for item in items), "'sum'")
    return sum(items, start)


class _BudgetedStream(io.StringIO):
    """A text stream that refuses to grow past the budget."""

    def write(self, text: str) -> int:
        check_size(self.tell() + len(text), "'pprint'")
        return super().write(text)


def _pprint(value: Any) -> str:
    """jinja2's pprint (pprint.pformat), refused when the value's repr, or the printed text, would not fit."""
    check_size(repr_size(value), "'pprint'")  # pformat builds the whole repr first
    stream = _BudgetedStream()
    pprint.PrettyPrinter(stream=stream).pprint(value)
    return stream.getvalue()[:-1]  # pprint() ends with a newline that pformat() does not write


# --- time ------------------------------------------------------------------------------------------------------

def render_within(template: jinja2.Template, seconds: float, /, **variables: Any) -> str:
    """template.render(**variables), raising RenderTimeout once it has run `seconds` (positional-only: a variable may
    be called `template`, `seconds` or `self`)."""
    deadline = time.monotonic() + seconds

    def check_clock() -> None:
        if time.monotonic() > deadline:
            raise RenderTimeout(f"the chat template ran longer than {seconds:g} s")

    def in_template(frame, event, arg):
        check_clock()
        return in_template

    def on_call(frame, event, arg):
        # any Python function the template calls (pprint, textwrap, a filter's generator) counts against the budget
        check_clock()
        return in_template if frame.f_code.co_filename == TEMPLATE_FILENAME else None

    previous = sys.gettrace()
    sys.settrace(on_call)
    try:
        return template.render(variables)  # one mapping: a variable may be called `self` (render's own parameter)
    finally:
        sys.settrace(previous)
