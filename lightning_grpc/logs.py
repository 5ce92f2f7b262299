"""How every process of lightning-grpc logs: one line per record, ``key=value`` events, to stdout.

The CLI, runner processes and the trainer's child processes call :func:`configure_logging` once. Every
module takes its logger from ``get_logger(__name__)`` (:func:`get_logger`), whose filter makes each value
a record carries safe to print, in one place: values that came from callers (ids, model names, reasons,
headers, paths, error messages) are clipped to :data:`MAX_VALUE_CHARS`, control characters are escaped (a
newline, or a ``%0A`` decoded from a URL, cannot start a new line), and a value holding a space, a quote or
``=`` is quoted, so it cannot pass for another ``key=value`` field such as ``event=``. Numbers pass
unchanged.
"""

from __future__ import annotations

import logging
import re
import sys
from collections.abc import Mapping
from typing import Any

#: The longest value a log line carries (an id is ~40 characters; a model name or reason rarely 100).
MAX_VALUE_CHARS = 300
#: The longest log line (a folded traceback included).
MAX_LINE_CHARS = 16_000

_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")
_NEEDS_QUOTES = re.compile(r"[\s\"'=]")


def clip(text: str, limit: int = MAX_VALUE_CHARS) -> str:
    """``text`` cut to at most ``limit`` characters, saying how much was left out."""
    if len(text) <= limit:
        return text
    note = f"…(+{len(text) - limit} chars)"
    return text[: max(0, limit - len(note))] + note


def escape(text: str) -> str:
    """Control characters as visible escapes (``\\n``, ``\\x1b``, ...)."""
    return _CONTROL.sub(lambda m: repr(m.group())[1:-1], text)


def field_value(value: Any, limit: int = MAX_VALUE_CHARS) -> str:
    """How an untrusted value is printed in a ``key=value`` log line: one clipped, escaped token."""
    text = escape(clip(value if isinstance(value, str) else str(value), limit))
    if not text or _NEEDS_QUOTES.search(text):
        return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return text


class _Safe:
    """A log argument printed safely by ``%s`` and ``%r`` alike."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def __str__(self) -> str:
        return field_value(self.value)

    def __repr__(self) -> str:
        if isinstance(self.value, str):
            return repr(clip(self.value))  # repr escapes control characters and keeps its quotes
        return field_value(repr(self.value))


def _safe(arg: Any) -> Any:
    if arg is None or isinstance(arg, (bool, int, float)):
        return arg  # %d, %.1f and friends need the number itself
    return _Safe(arg)


class SafeValues(logging.Filter):
    """Makes every argument of a record safe to print (see the module's docstring)."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple):
            record.args = tuple(_safe(a) for a in args)
        elif isinstance(args, Mapping):
            record.args = {k: _safe(v) for k, v in args.items()}
        return True


_SAFE_VALUES = SafeValues()


def get_logger(name: str) -> logging.Logger:
    """The logger ``name``, with the filter that makes the values of its records safe to print.

    Every module passes its ``__name__``, so a logger is named after its module and sits under the
    ``lightning_grpc`` logger (and its package's: ``lightning_grpc.store``, ``lightning_grpc.engine``, ...),
    where levels and capture are set for a whole component. A module run with ``python -m`` keeps its
    dotted name rather than ``__main__``.
    """
    if name == "__main__":
        spec = getattr(sys.modules.get("__main__"), "__spec__", None)
        name = spec.name if spec is not None and spec.name else name
    logger = logging.getLogger(name)
    if _SAFE_VALUES not in logger.filters:
        logger.addFilter(_SAFE_VALUES)
    return logger


class OneLineFormatter(logging.Formatter):
    """Every record on one line: an exception's traceback is folded into it with ' | ', and the line is
    clipped to :data:`MAX_LINE_CHARS`."""

    def format(self, record: logging.LogRecord) -> str:
        return clip(super().format(record).replace("\r", "").replace("\n", " | "), MAX_LINE_CHARS)


def configure_logging(level: str = "INFO") -> None:
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(OneLineFormatter("%(asctime)s %(levelname)s %(name)s %(message)s"))
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO), handlers=[handler], force=True)
    for chatty in ("httpx", "httpcore"):  # one INFO line per HTTP request an agent makes
        logging.getLogger(chatty).setLevel(max(logging.WARNING, logging.getLogger().level))
