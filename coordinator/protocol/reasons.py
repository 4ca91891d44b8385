"""How a fault is said: the ``Reason`` every reply carries, made in one place."""

from __future__ import annotations

import traceback

from coordinator.protocol.replies import Reason

MAX_MESSAGE = 1000


def reason(where: str, exc: BaseException) -> Reason:
    """A fault as the replies report it: ``where`` it happened, the exception ``type``, and a
    ``message`` of at most 1000 characters."""
    message = str(exc) or "".join(traceback.format_exception_only(exc)).strip()
    return {"where": where, "type": type(exc).__name__, "message": message[:MAX_MESSAGE]}


def is_exit(exc: BaseException) -> bool:
    """Whether ``exc`` is the interpreter's own way out (Ctrl-C, ``sys.exit``, a generator
    closing): code that catches ``BaseException`` to keep a fault from training re-raises
    these."""
    return isinstance(exc, (KeyboardInterrupt, SystemExit, GeneratorExit))
