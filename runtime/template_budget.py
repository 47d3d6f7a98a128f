"""Bounds on what an untrusted chat template may cost: time and the size of what it builds.

jinja2's sandbox keeps a template away from Python internals but not from work without end: nested loops over
`range(100000)` (the sandbox's own cap per range) run for hours, and `'a' * 300000000` allocates 300 MB in one
step. A template renders for every request of a server, so either would hang or exhaust it.

- `BudgetedSandbox` refuses `*`, `+` and `**` whose result would exceed MAX_BUILT_ITEMS characters or items (or
  an integer power beyond 2**MAX_POWER_BITS);
- `render_within(template, seconds, ...)` stops a render that runs longer than `seconds` (a trace function on the
  template's own frames checks the clock; other code is not traced and runs at full speed).
"""

from __future__ import annotations

import sys
import time
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

MAX_BUILT_ITEMS = 1 << 24  # 16 M characters (or list items) in one value built by * or +
MAX_POWER_BITS = 4096
TEMPLATE_FILENAME = "<template>"  # what jinja2 compiles a template from a string under


class RenderTimeout(Exception):
    """A template ran past its time budget."""


class BudgetedSandbox(ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset(["*", "+", "**"])

    def call_binop(self, context: jinja2.runtime.Context, operator: str, left: Any, right: Any) -> Any:
        if operator == "*":
            sequence, count = (left, right) if _sized(left) else (right, left)
            if _sized(sequence) and isinstance(count, int) and len(sequence) * count > MAX_BUILT_ITEMS:
                raise SecurityError(f"the template builds a value of {len(sequence) * count} items with '*' "
                                    f"(at most {MAX_BUILT_ITEMS})")
        elif operator == "+" and _sized(left) and _sized(right) and len(left) + len(right) > MAX_BUILT_ITEMS:
            raise SecurityError(f"the template builds a value of {len(left) + len(right)} items with '+' (at most "
                                f"{MAX_BUILT_ITEMS})")
        elif operator == "**" and isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and \
                right * max(abs(left).bit_length(), 1) > MAX_POWER_BITS:
            raise SecurityError(f"the template raises {left} to the power {right} (at most {MAX_POWER_BITS} bits)")
        return super().call_binop(context, operator, left, right)


def _sized(value: Any) -> bool:
    return isinstance(value, (str, list, tuple))


def render_within(template: jinja2.Template, seconds: float, /, **variables: Any) -> str:
    """template.render(**variables), raising RenderTimeout once it has run `seconds` (positional-only: a variable may
    be called `template`, `seconds` or `self`)."""
    deadline = time.monotonic() + seconds

    def in_template(frame, event, arg):
        if time.monotonic() > deadline:
            raise RenderTimeout(f"the chat template ran longer than {seconds:g} s")
        return in_template

    def on_call(frame, event, arg):
        return in_template if frame.f_code.co_filename == TEMPLATE_FILENAME else None

    previous = sys.gettrace()
    sys.settrace(on_call)
    try:
        return template.render(variables)  # one mapping: a variable may be called `self` (render's own parameter)
    finally:
        sys.settrace(previous)
