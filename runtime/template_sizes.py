"""How large a value a chat template builds would be, predicted without building it (runtime/template_budget.py
refuses what would exceed MAX_BUILT_ITEMS before it is allocated).

Every function here gives an upper bound (exact for plain strings): on the text of a value (`text_size`,
`repr_size`, `json_size`, `escaped_size`), on the result of `%` formatting, of a str / bytes / int method
(`method_size`), and of the growing filters and globals (FILTER_SIZES, `lipsum_size`). Counting stops once past the
budget, so measuring a huge value costs about the budget, not the value.
"""

from __future__ import annotations

import builtins
import json
import re
from collections.abc import Callable, ItemsView, Iterable, KeysView, Mapping, ValuesView
from typing import Any

import jinja2
import jinja2.utils
from jinja2.sandbox import SecurityError
from markupsafe import Markup

MAX_BUILT_ITEMS = 1 << 24  # 16 M characters (or list items) in one value a template builds, or in its output
_SLICE = 1 << 16  # characters escaped at a time when measuring a string's repr / JSON exactly
_FLOAT_TEXT = 330  # '%f' / '{:f}' of the largest float: 309 digits and a fraction
_LINE_BREAKS = ("\n", "\r", "\v", "\f", "\x1c", "\x1d", "\x1e", "\x85", "\u2028", "\u2029")  # str.splitlines'


def check_size(size: int, what: str) -> None:
    """Raise SecurityError (one line, naming `what`) when `size` characters or items exceed MAX_BUILT_ITEMS."""
    if size > MAX_BUILT_ITEMS:
        raise SecurityError(f"the template builds a value of {size} items with {what} (at most {MAX_BUILT_ITEMS})")


# --- estimating a value's text without building it -------------------------------------------------------------

class _Measure:
    """Upper bounds on the length of repr() (or json.dumps) of a value, walking it once: containers are memoised
    by identity, so a list that holds itself or one list many times (2**40 leaves in 40 steps) costs its distinct
    objects, not its text. Counting stops once past `limit` (the result is then some number above it)."""

    def __init__(self, limit: int, *, as_json: bool = False, ensure_ascii: bool = False, item_separator: int = 2,
                 key_separator: int = 2, indent: int = 0):
        self.limit, self.as_json, self.ensure_ascii = limit, as_json, ensure_ascii
        self.item_separator, self.key_separator, self.indent = item_separator, key_separator, indent
        self.memo: dict[tuple[int, int], int] = {}
        self.active: set[int] = set()

    def size(self, value: Any, depth: int = 0) -> int:
        if isinstance(value, str):
            return self.quoted(value)
        if value is None or isinstance(value, bool):
            return 5
        if isinstance(value, int):
            return int(value.bit_length() * 0.302) + 2
        if isinstance(value, float):
            return 24
        if isinstance(value, (bytes, bytearray)):
            return 4 * len(value) + 3
        if isinstance(value, jinja2.Undefined):
            return 9
        if isinstance(value, jinja2.utils.Namespace):  # '<Namespace {...}>'
            return 12 + self.size(object.__getattribute__(value, "_Namespace__attrs"), depth)
        if isinstance(value, (Mapping, list, tuple, set, frozenset, KeysView, ValuesView, ItemsView)):
            return self.container(value, depth)
        if isinstance(value, range):
            return 40
        # what else a template reaches (macros, loops, cyclers, functions, generators) has a short fixed repr
        return len(repr(value))

    def quoted(self, text: str) -> int:
        if text.isprintable() and (text.isascii() or not (self.as_json and self.ensure_ascii)):
            return len(text) + 2 + text.count("\\") + text.count("'") + text.count('"')
        escape = (lambda part: json.dumps(part, ensure_ascii=self.ensure_ascii)) if self.as_json else repr
        total = 2
        for start in range(0, len(text), _SLICE):
            total += len(escape(text[start:start + _SLICE])) - 2
            if total > self.limit:
                break
        return total

    def container(self, value: Any, depth: int) -> int:
        key = (id(value), depth)
        if key in self.memo:
            return self.memo[key]
        if id(value) in self.active:  # repr writes '[...]' for a container inside itself
            return 5
        self.active.add(id(value))
        try:
            # brackets and a type name ('dict_items(', 'frozenset('), and the closing line of an indented one
            total = 16 + (1 + self.indent * depth if self.indent else 0)
            per_item = self.item_separator + (1 + self.indent * (depth + 1) if self.indent else 0)
            mapping = isinstance(value, Mapping)
            for item in (value.items() if mapping else value):
                if mapping:
                    total += self.size(item[0], depth + 1) + self.key_separator + self.size(item[1], depth + 1)
                else:
                    total += self.size(item, depth + 1)
                total += per_item
                if total > self.limit:
                    break
        finally:
            self.active.discard(id(value))
        self.memo[key] = total
        return total


def text_size(value: Any, limit: int = MAX_BUILT_ITEMS) -> int:
    """An upper bound on len(str(value)) (exact for a str), found without building it; past `limit` it is just
    some number above `limit`."""
    return len(value) if isinstance(value, str) else _Measure(limit).size(value)


def repr_size(value: Any, limit: int = MAX_BUILT_ITEMS) -> int:
    """An upper bound on len(repr(value)), as text_size."""
    return _Measure(limit).size(value)


def json_size(value: Any, *, indent: int | str | None = None, separators: tuple[str, str] | None = None,
              ensure_ascii: bool = False, limit: int = MAX_BUILT_ITEMS) -> int:
    """An upper bound on len(json.dumps(value, indent=..., separators=..., ensure_ascii=...)), as text_size."""
    if separators is None:
        separators = (", " if indent is None else ",", ": ")
    indent_size = len(indent) if isinstance(indent, str) else max(indent or 0, 0) if indent is not None else 0
    return _Measure(limit, as_json=True, ensure_ascii=ensure_ascii, item_separator=len(separators[0]),
                    key_separator=len(separators[1]), indent=indent_size).size(value)


def escaped_size(value: Any) -> int:
    """An upper bound on len(markupsafe.escape(value))."""
    if isinstance(value, Markup):
        return len(value)
    if isinstance(value, str):
        return len(value) + 3 * (value.count("<") + value.count(">")) + 4 * (
            value.count("&") + value.count("'") + value.count('"'))
    return 5 * text_size(value, MAX_BUILT_ITEMS // 5) + 1


def case_size(text: Any) -> int:
    """An upper bound on the length of a case change (upper, title...): one character may become three."""
    if isinstance(text, (str, bytes, bytearray)):
        return len(text) if text.isascii() else 3 * len(text)
    return 3 * text_size(text)


def _line_count(text: str) -> int:
    return 1 + sum(text.count(mark) for mark in _LINE_BREAKS)


def _number(value: Any, default: int = 0) -> int:
    return value if isinstance(value, int) else default


# --- predicted sizes of operators and methods -------------------------------------------------------------------

_PERCENT = re.compile(r"%(?:\(([^)]*)\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d+))?[hlL]?(.)?", re.S)


def percent_size(template: str | bytes, arguments: Any) -> int:
    """An upper bound on len(template % arguments): the literal text plus, per conversion, its value's text and its
    width and precision (stops counting once past MAX_BUILT_ITEMS)."""
    if isinstance(template, bytes):
        template = template.decode("latin-1")
    positional = arguments if isinstance(arguments, tuple) else (arguments,)
    total, position = len(template), 0
    for match in _PERCENT.finditer(template):
        key, width, precision, kind = match.groups()
        if kind == "%" and key is None:
            continue
        for number in (width, precision):
            if number == "*":
                total += abs(_number(positional[position] if position < len(positional) else 0))
                position += 1
            elif number:
                total += int(number)
        if key is not None:
            value = arguments.get(key) if isinstance(arguments, Mapping) else None
        else:
            value = positional[position] if position < len(positional) else None
            position += 1
        total += field_size(value, repr_wanted=kind in ("r", "a"))
        if total > MAX_BUILT_ITEMS:
            break
    return total


def field_size(value: Any, *, repr_wanted: bool = False) -> int:
    if isinstance(value, float):
        return _FLOAT_TEXT
    if isinstance(value, int) and not isinstance(value, bool):  # a thousands separator per three digits
        return text_size(value) * 4 // 3 + 1
    return repr_size(value) if repr_wanted else text_size(value)


def spec_numbers(spec: str) -> int:
    return sum(int(number) for number in re.findall(r"\d+", spec))


def method_size(owner: Any, name: str, args: tuple, kwargs: dict) -> int | None:
    """The predicted size of `owner.name(*args, **kwargs)` for a str / bytes / int method that can build more
    than its input, None for any other call. Arguments are only read here; the call itself reports bad ones."""
    if isinstance(owner, int) and not isinstance(owner, bool):
        return _number(args[0] if args else kwargs.get("length", 1)) if name == "to_bytes" else None
    if not isinstance(owner, (str, bytes, bytearray)):
        return None
    size = len(owner)
    if name in ("center", "ljust", "rjust", "zfill"):
        return max(size, _number(args[0] if args else kwargs.get("width", 0)))
    if name == "expandtabs":
        tab = owner.count("\t" if isinstance(owner, str) else b"\t")
        return size + tab * max(_number(args[0] if args else kwargs.get("tabsize", 8), 8), 0)
    if name == "replace" and len(args) >= 2 and type(args[0]) is type(args[1]) and hasattr(args[0], "__len__"):
        old, new = args[0], args[1]
        count = _number(args[2] if len(args) > 2 else kwargs.get("count", -1), -1)
        occurrences = owner.count(old) if len(old) else size + 1
        return size + (occurrences if count < 0 else min(count, occurrences)) * max(len(new) - len(old), 0)
    if name in ("upper", "lower", "title", "capitalize", "swapcase", "casefold"):
        return case_size(owner)
    if name == "encode":
        return 10 * size  # '\U0010ffff' is the longest escape a codec writes for one character
    if name == "hex":
        separator = args[0] if args else kwargs.get("sep", "")
        return size * (2 + (len(separator) if hasattr(separator, "__len__") else 1))
    if name == "translate" and args and isinstance(args[0], (Mapping, list, tuple)):
        table = args[0].values() if isinstance(args[0], Mapping) else args[0]
        longest = max((len(item) for item in table if isinstance(item, (str, bytes))), default=1)
        return size * max(longest, 1)
    return None


# --- predicted sizes of filters and globals -------------------------------------------------------------------

def _indent_size(s: Any, width: int | str = 4, first: bool = False, blank: bool = False) -> int:
    indent = len(width) if isinstance(width, str) else max(_number(width), 0)
    size = text_size(s)
    return size + 1 + (_line_count(s) if isinstance(s, str) else size + 1) * (indent + 1)


def _replace_size(s: Any, old: Any, new: Any, count: int | None = None) -> int:
    text, size = s, text_size(s)
    if not (isinstance(text, str) and isinstance(old, str) and isinstance(new, str)):
        return 6 * size * max(text_size(new), 1)  # rare: measured against the worst case
    return method_size(text, "replace", (old, new, -1 if count is None else count), {})


def _wordwrap_size(s: Any, width: int = 79, break_long_words: bool = True, wrapstring: str | None = None,
                   break_on_hyphens: bool = True) -> int:
    size = text_size(s)
    return size + (size + 1) * max(text_size(wrapstring) if wrapstring is not None else 1, 1)


def _urlize_size(value: Any, trim_url_limit: int | None = None, nofollow: bool = False, target: str | None = None,
                 rel: str | None = None, extra_schemes: Iterable[str] | None = None) -> int:
    size = text_size(value)
    return 12 * size + (size // 2 + 1) * (64 + text_size(target or "") + text_size(rel or ""))


def _xmlattr_size(d: Any, autospace: bool = True) -> int:
    return 6 * text_size(d) + 1


def _format_size(value: Any, *args: Any, **kwargs: Any) -> int:
    return percent_size(value, kwargs or args) if isinstance(value, str) else text_size(value)


def _batch_size(value: Any, linecount: int, fill_with: Any = None) -> int:
    return _number(linecount) if fill_with is not None else 0


def _slice_size(value: Any, slices: int, fill_with: Any = None) -> int:
    return _number(slices)


def lipsum_size(n: int = 5, html: bool = True, min: int = 20, max: int = 100) -> int:  # noqa: A002 - jinja2's
    return builtins.max(n, 0) * builtins.max(min, max, 0) * 16  # words of at most 14 letters, a space, punctuation

FILTER_SIZES: dict[str, Callable[..., int]] = {
    "center": lambda value, width=80: max(text_size(value), _number(width)),
    "indent": _indent_size,
    "replace": _replace_size,
    "format": _format_size,
    "wordwrap": _wordwrap_size,
    "truncate": lambda s, length=255, killwords=False, end="...", leeway=None: text_size(s) + text_size(end),
    "string": text_size,
    "escape": escaped_size,
    "e": escaped_size,
    "forceescape": escaped_size,
    "urlencode": lambda value: 12 * text_size(value),
    "urlize": _urlize_size,
    "xmlattr": _xmlattr_size,
    "upper": case_size,
    "lower": case_size,
    "title": case_size,
    "capitalize": case_size,
    "batch": _batch_size,
    "slice": _slice_size,
}
