"""The checked field types of a run's record: what a record file may hold, declared once.

A record is data, never a path or a name to trust: whoever can write ``save_path`` can write
it. So the decoder (``record_codec``) checks each field as the config and the RPCs check the
same values when they come in: trainer ids and roles match ``validate.TRAINER_ID`` (a role
names a directory), ranks are below ``MAX_WORLD``, every string and every collection has a
length limit. A file that breaks one is refused whole, with the field named. Pure: no I/O.
"""

from __future__ import annotations

from typing import Annotated, TypedDict

import msgspec

from coordinator.core.validate import MAX_TEXT, MAX_WORLD, TRAINER_ID

MAX_PATH = 4096
"""The longest path or URL (Linux's ``PATH_MAX``)."""
MAX_NODE = 256
"""The longest node id or node name (Ray's ids are 56 hex digits; a host name, 253)."""
MAX_TRAINERS = 1024
"""The most trainers (roles) a window or a run holds."""
MAX_KEYS = 1 << 18
"""The most ranks of all trainers one window file lists, in all its rank sets together
(participants, acked, traces and both pending sets: ``record_codec.window_keys`` counts them
before anything is decoded). 262,144: a window of 10,000 ranks (the scale target) lists at
most 50,000, one of 52,000 ranks still reads; a hostile file made of keys alone (about 6 bytes
each in the file, about 110 in memory) is refused before it costs more than a few times its
size, and one under the cap costs at most about 30 MB more than its size."""

Name = Annotated[str, msgspec.Meta(pattern=TRAINER_ID.pattern)]
"""A trainer id or a role: 1-64 letters, digits, '.', '_' or '-' (never a path)."""
RunName = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,159}$")]
"""A run's name: the config's (1-128 characters), with ``.N`` when it was taken."""
Rank = Annotated[int, msgspec.Meta(ge=0, lt=MAX_WORLD)]
Path = Annotated[str, msgspec.Meta(max_length=MAX_PATH)]
Node = Annotated[str, msgspec.Meta(max_length=MAX_NODE)]
Text = Annotated[str, msgspec.Meta(max_length=MAX_TEXT)]
Key = tuple[Name, Rank]
"""A rank of a trainer: ``(trainer_id, rank)``."""
Keys = Annotated[set[Key], msgspec.Meta(max_length=MAX_KEYS)]
Ranks = Annotated[list[Rank], msgspec.Meta(max_length=MAX_WORLD)]


class TraceFile(TypedDict):
    """``replies.WindowTrace`` as a record holds it: the same keys, each checked."""

    path: Path | None
    local_path: Path | None
    node: Node | None
    error: Annotated[dict[Annotated[str, msgspec.Meta(max_length=1000)], Text],
                     msgspec.Meta(max_length=8)] | None  # fmt: skip


Traces = Annotated[list[tuple[Name, Rank, TraceFile]], msgspec.Meta(max_length=MAX_KEYS)]
