"""Protobuf framing by hand, for the hot span paths that splice serialized spans without parsing them."""

from __future__ import annotations


def varint(n: int) -> bytes:
    """A non-negative integer in Protobuf's varint encoding."""
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        out.append(b | 0x80 if n else b)
        if not n:
            return bytes(out)


def length_delimited(tag: int, data: bytes) -> bytes:
    """A length-delimited field (``tag`` is the field's key byte, e.g. 0x0A for field 1) carrying ``data``."""
    return bytes((tag,)) + varint(len(data)) + data
