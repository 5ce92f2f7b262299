"""How every process of lightning-grpc logs: one line per record, ``key=value`` events, to stdout.

The CLI, runner processes and the trainer's child processes call :func:`configure_logging` once.
"""

from __future__ import annotations

import logging
import sys


class OneLineFormatter(logging.Formatter):
    """Every record on one line: an exception's traceback is folded into it with ' | '."""

    def format(self, record: logging.LogRecord) -> str:
        return super().format(record).replace("\n", " | ")


def configure_logging(level: str = "INFO") -> None:
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(OneLineFormatter("%(asctime)s %(levelname)s %(name)s %(message)s"))
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO), handlers=[handler], force=True)
    for chatty in ("httpx", "httpcore"):  # one INFO line per HTTP request an agent makes
        logging.getLogger(chatty).setLevel(max(logging.WARNING, logging.getLogger().level))
