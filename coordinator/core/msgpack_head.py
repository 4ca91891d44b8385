"""What a msgpack value's first bytes say, read without decoding it: a record file's
collections are counted from their headers before anything of them is decoded (a hostile file
of millions of small items costs no more than its size). Pure."""

from __future__ import annotations

import msgspec


def array_length(raw: msgspec.Raw | bytes) -> int:
    """The length of the msgpack array ``raw`` starts with (0 for anything else: the full
    decode names its type).

    >>> array_length(msgspec.msgpack.encode(list(range(70000))))
    70000
    >>> array_length(msgspec.msgpack.encode({"a": 1}))
    0
    """
    head = bytes(memoryview(raw)[:5])
    if head and 0x90 <= head[0] <= 0x9F:
        return head[0] & 0x0F
    if head[:1] == b"\xdc":
        return int.from_bytes(head[1:3], "big")
    if head[:1] == b"\xdd":
        return int.from_bytes(head[1:5], "big")
    return 0
