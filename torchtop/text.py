"""Text that torchtop did not write, made safe to show. Standard library only.

A job's argv, its phase names, log lines, device names and exit reasons, a recording someone
sent, a relay's refusal and another user's command line all reach a terminal. A control
character among them could move the cursor, clear the screen, set the window title
(``ESC ] 0;``) or write the clipboard (``ESC ] 52;``). Every such string passes
:func:`printable` before it is shown: each C0 or C1 control character (``ESC`` included), each
bidirectional override and each lone surrogate (a ``\\ud800`` in a JSON frame, which no
terminal encoding can write) is shown as its escape, ``\\x1b``. Tabs and newlines are text:
a log line keeps its layout, unless the place it is shown holds one line only
(``one_line=True``).

:func:`printable_message` does the same for every string inside a message, so that what the
model folds is safe wherever it is shown. Escaping is not markup escaping: code that hands a
string to Rich or Textual passes it as ``Text``, never as markup.
"""

from __future__ import annotations

import dataclasses
import operator
import types
import typing
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

T = TypeVar("T")


def _escape(code: int) -> str:
    if code == 0x0D:
        return "\\r"
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def _table(codes: Iterable[int]) -> dict[int, str]:
    return {code: _escape(code) for code in codes}


#: Shown escaped everywhere: C0 controls but tab and newline, DEL and C1 controls, the line and
#: paragraph separators, the bidirectional embeddings, overrides and isolates (text that reads
#: differently from what it is), and lone surrogates.
_ESCAPED = _table(
    [
        *(c for c in range(0x20) if c not in (0x09, 0x0A)),
        *range(0x7F, 0xA0),
        0x2028,
        0x2029,
        *range(0x202A, 0x202F),
        *range(0x2066, 0x206A),
        *range(0xD800, 0xE000),
    ]
)
#: Where one line is shown (a table cell, a header, a row of ``torchtop ps``).
_ESCAPED_ONE_LINE = {**_ESCAPED, 0x09: "\\t", 0x0A: "\\n"}


def printable(text: str, *, one_line: bool = False) -> str:
    """``text`` with every character that a terminal would act on shown as its escape
    (``\\x1b``); tabs and newlines kept unless ``one_line``."""
    if text.isprintable():  # nothing to escape: the common case, and cheap
        return text
    return text.translate(_ESCAPED_ONE_LINE if one_line else _ESCAPED)


#: For each dataclass, the fields whose values may hold text.
_TEXT_FIELDS: dict[type, tuple[str, ...]] = {}
_PLAIN_TYPES = (int, float, bool, type(None))


def _may_hold_text(hint: Any) -> bool:
    """Whether a value of type ``hint`` can hold a string (``True`` when unsure)."""
    if hint in _PLAIN_TYPES:
        return False
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType, list, tuple, dict):
        args = [arg for arg in typing.get_args(hint) if arg is not Ellipsis]
        return not args or any(_may_hold_text(arg) for arg in args)
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return bool(_text_fields(hint))
    return True


def _text_fields(cls: type) -> tuple[str, ...]:
    """The fields of the dataclass ``cls`` whose values may hold text (not numbers or flags)."""
    names = _TEXT_FIELDS.get(cls)
    if names is None:
        _TEXT_FIELDS[cls] = tuple(f.name for f in dataclasses.fields(cls))  # while recursing
        try:
            hints = typing.get_type_hints(cls)
        except Exception:  # an annotation that cannot be resolved: look at every value
            hints = {}
        names = tuple(
            f.name
            for f in dataclasses.fields(cls)
            if f.init and (f.name not in hints or _may_hold_text(hints[f.name]))
        )
        _TEXT_FIELDS[cls] = names
    return names


def printable_message(value: T) -> T:
    """``value`` (a message: a dataclass, or a list, dict or string within one) with every string
    in it passed through :func:`printable`; the same object when nothing needed escaping, so a
    message of plain text costs a look at its strings and no copy."""
    if _is_plain(value):  # the common case, for every frame of a day-long job: a quick look
        return value
    return typing.cast(T, _printable_value(value))


#: For each dataclass, a function that gives the values of its fields that may hold text.
_GETTERS: dict[type, Callable[[Any], Iterable[Any]]] = {}


def _getter(cls: type) -> Callable[[Any], Iterable[Any]] | None:
    getter = _GETTERS.get(cls)
    if getter is None:
        if not dataclasses.is_dataclass(cls):
            return None
        names = _text_fields(cls)
        if len(names) == 1:
            one = operator.attrgetter(names[0])
            getter = lambda obj: (one(obj),)  # noqa: E731
        elif names:
            getter = typing.cast(Callable[[Any], Iterable[Any]], operator.attrgetter(*names))
        else:
            getter = lambda obj: ()  # noqa: E731
        _GETTERS[cls] = getter
    return getter


def _is_plain(value: Any) -> bool:
    """True when no string in ``value`` has anything to escape (``False`` when unsure)."""
    kind = type(value)
    if kind is str:
        return value.isprintable()
    if kind in _PLAIN_TYPES:
        return True
    if kind is list or kind is tuple:
        return all(map(_is_plain, value))
    if kind is dict:
        return all(map(_is_plain, value)) and all(map(_is_plain, value.values()))
    getter = _getter(kind)
    return getter is not None and all(map(_is_plain, getter(value)))


def _printable_value(value: Any) -> Any:
    if isinstance(value, str):
        if value.isprintable():
            return value
        shown = printable(value)
        return value if shown == value else shown
    if isinstance(value, _PLAIN_TYPES):
        return value
    if isinstance(value, list):
        items = [_printable_value(item) for item in value]
        same = all(new is old for new, old in zip(items, value, strict=True))
        return value if same else items
    if isinstance(value, tuple):
        items = [_printable_value(item) for item in value]
        same = all(new is old for new, old in zip(items, value, strict=True))
        return value if same else tuple(items)
    if isinstance(value, dict):
        pairs = [(_printable_value(k), _printable_value(v)) for k, v in value.items()]
        same = all(
            nk is k and nv is v for (nk, nv), (k, v) in zip(pairs, value.items(), strict=True)
        )
        return value if same else dict(pairs)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        changes = {}
        for name in _text_fields(type(value)):
            old = getattr(value, name)
            new = _printable_value(old)
            if new is not old:
                changes[name] = new
        return dataclasses.replace(value, **changes) if changes else value
    return value
