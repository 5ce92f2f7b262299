"""Commands that look at a running store (filled in by the inspection commands)."""

from __future__ import annotations

import argparse


def add_parsers(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    return None
