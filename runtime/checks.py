"""Type and range checks of single user-supplied values. Each returns the value as a plain Python int/float/str
(numpy scalars included) or raises InvalidArgumentError naming the parameter. bool is never accepted where a
number is expected: `max_new_tokens=True` is a mistake, not one token. `name` is what the message calls the value
(e.g. "prompt_ids[0][3]"); `param`, when given, the argument it belongs to (default: `name`)."""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterable, Mapping
from itertools import islice
from numbers import Integral, Real
from typing import Any

from fxllm.errors import InvalidArgumentError


def short(value: Any) -> str:
    """repr(value), cut to 60 characters: an error message stays one readable line whatever the value."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def describe(value: Any) -> str:
    """A bad value's type and short repr, for an error message."""
    return f"{type(value).__name__} {short(value)}"


def integer(name: str, value: Any, minimum: int | None = None, maximum: int | None = None, *,
            param: str | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise InvalidArgumentError(param or name, f"{name} must be an integer, got {describe(value)}")
    value = int(value)
    _check_range(name, param or name, value, minimum, maximum)
    return value


def real(param: str, value: Any, minimum: float | None = None, maximum: float | None = None,
         above: float | None = None) -> float:
    """A finite number (int or float); `above` is an exclusive lower bound."""
    if isinstance(value, bool) or not isinstance(value, Real):
        raise InvalidArgumentError(param, f"{param} must be a number, got {describe(value)}")
    try:
        number = float(value)
    except OverflowError:  # an int beyond float's range
        number = math.inf
    if not math.isfinite(number):
        raise InvalidArgumentError(param, f"{param} must be a finite number, got {short(value)}")
    if above is not None and not number > above:
        raise InvalidArgumentError(param, f"{param} must be > {above:g}, got {number:g}")
    _check_range(param, param, number, minimum, maximum)
    return number


def flag(param: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise InvalidArgumentError(param, f"{param} must be True or False, got {describe(value)}")
    return value


def text(name: str, value: Any, *, param: str | None = None) -> str:
    """A str that is valid Unicode: no lone surrogates (what Python makes of command-line bytes that are not UTF-8),
    which no tokenizer can encode."""
    if not isinstance(value, str):
        raise InvalidArgumentError(param or name, f"{name} must be a string, got {describe(value)}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        surrogate = value[exc.start]
        message = f"{name} is not valid Unicode: a lone surrogate {surrogate!r} at character {exc.start}"
        if 0xDC80 <= ord(surrogate) <= 0xDCFF:  # how Python holds a command line's or a file name's stray bytes
            message += f" (the byte 0x{ord(surrogate) - 0xDC00:02x}, which is not UTF-8)"
        raise InvalidArgumentError(param or name, message) from None
    return value


def path(param: str, value: Any, error: Callable[[str], Exception] | None = None, *, utf8: bool = True) -> str:
    """A filesystem path given as a str or an os.PathLike (pathlib.Path) → its text. Anything else raises
    `error(message)`, default InvalidArgumentError(param, message): None, bytes or a number (pathlib's TypeError
    would name no argument, and str(None) would quietly be the path 'None'); and, unless `utf8` is False (a path
    only Python opens), a name with bytes that are not UTF-8 (Python holds them as lone surrogates), which onnx and
    ONNX Runtime cannot open: they failed with a binding's TypeError, a compile's after all its work."""
    if isinstance(value, str) or isinstance(value, os.PathLike) and isinstance(os.fspath(value), str):
        name = os.fspath(value)
        try:
            if utf8:
                name.encode("utf-8")
            return name
        except UnicodeEncodeError as exc:
            raw = os.fsencode(name[exc.start])
            message = (f"{param} {short(name)} is not valid UTF-8 (byte 0x{raw.hex()} at character {exc.start}); "
                       "onnx and ONNX Runtime cannot open such a path; use a name that is valid UTF-8")
    else:
        message = f"{param} must be a path (a string or a pathlib.Path), got {describe(value)}"
    raise error(message) if error is not None else InvalidArgumentError(param, message)


def strings(param: str, value: Any, most: int | None = None, most_chars: int | None = None) -> tuple[str, ...]:
    """None (none), one string, or an iterable of strings, each valid Unicode (as `text`); at most `most` strings
    (counted before any is checked) of at most `most_chars` characters each, where given."""
    if value is None:
        return ()
    if isinstance(value, str):
        named = [(param, value)]
    elif isinstance(value, (bytes, Mapping)) or not isinstance(value, Iterable):
        raise InvalidArgumentError(param, f"{param} must be a string or a list of strings, got {describe(value)}")
    else:
        items = list(value if most is None else islice(value, most + 1))
        if most is not None and len(items) > most:
            raise InvalidArgumentError(param, f"{param} holds more than {most} strings")
        named = [(f"{param}[{i}]", item) for i, item in enumerate(items)]
    checked = tuple(text(name, item, param=param) for name, item in named)
    for (name, _), item in zip(named, checked):
        if most_chars is not None and len(item) > most_chars:
            raise InvalidArgumentError(param, f"{name} has {len(item):,} characters; at most {most_chars:,}")
    return checked


MAX_TOKEN_ID_DIGITS = 18  # an int64; no vocabulary comes near (and int() of 5,000 digits raises)


def token_id_text(text: str) -> int | None:
    """A token id written as text (a logit_bias key, '50256'): ASCII decimal digits only — no sign, space, '_' or
    another script's digits, which int() would take — at most MAX_TOKEN_ID_DIGITS of them; None for anything else."""
    if 0 < len(text) <= MAX_TOKEN_ID_DIGITS and text.isascii() and text.isdecimal():
        return int(text)
    return None


def integers(param: str, value: Any, minimum: int | None = None, maximum: int | None = None,
             most: int | None = None) -> tuple[int, ...]:
    """An iterable of integers (as `integer`, each in range); at most `most` of them (counted before any is
    checked), where given."""
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Iterable):
        raise InvalidArgumentError(param, f"{param} must be a list of integers, got {describe(value)}")
    if plain_ints_within(value, minimum, maximum) and (most is None or len(value) <= most):
        return value  # already checked (dataclasses.replace checks a SamplingParams' stored tuples again)
    items = list(value if most is None else islice(value, most + 1))
    if most is not None and len(items) > most:
        raise InvalidArgumentError(param, f"{param} holds more than {most:,} token ids")
    return tuple(integer(f"{param}[{i}]", item, minimum, maximum, param=param) for i, item in enumerate(items))


def plain_ints_within(value: Any, minimum: int | None, maximum: int | None) -> bool:
    """Whether `value` is a tuple of Python ints (not bools) in range: the fast path of a list checked before, where
    checking each item on its own took ~1 µs an id (0.1 s for a server request's 65,536 ids, once per choice)."""
    if type(value) is not tuple or not all(type(item) is int for item in value):
        return False
    return not value or ((minimum is None or min(value) >= minimum) and (maximum is None or max(value) <= maximum))


def _check_range(name: str, param: str, value: float, minimum: float | None, maximum: float | None) -> None:
    if minimum is not None and value < minimum:
        raise InvalidArgumentError(param, f"{name} must be >= {_bound(minimum)}, got {short(value)}")
    if maximum is not None and value > maximum:
        raise InvalidArgumentError(param, f"{name} must be <= {_bound(maximum)}, got {short(value)}")


def _bound(value: float) -> str:
    """A range's bound as written: an int exactly (-9223372036854775808, not -9.22337e+18), a float shortest."""
    return str(value) if isinstance(value, int) else f"{value:g}"


def byte_size(nbytes: float) -> str:
    """A byte count in the largest binary unit that keeps it at least 1: '512 B', '65.8 KiB', '1.3 MiB', '1.8 PiB'."""
    exponent = min(int(math.log(max(nbytes, 1), 1024)), 5)
    unit = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"][exponent]
    return f"{nbytes:.0f} B" if exponent == 0 else f"{nbytes / 1024 ** exponent:.1f} {unit}"
