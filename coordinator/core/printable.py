"""Text from a record or a reply made safe for a terminal: a record is data anyone who can
write ``save_path`` made, and an escape sequence in a culprit or a path would move the cursor,
recolour or retitle the reader's terminal. Pure."""

from __future__ import annotations


def printable(text: str) -> str:
    """``text`` with each character that does not print (control characters, escape
    sequences' ESC, bidirectional overrides, line breaks) written as its escape.

    >>> printable("rank 3\\x1b[2J\\nnext")
    'rank 3\\\\x1b[2J\\\\nnext'
    >>> printable("node-a: no NVML")
    'node-a: no NVML'
    """
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
