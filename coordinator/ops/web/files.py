"""Files the web server sends from a folder (its own pages, Perfetto's build): which request
paths may name one, and the type it is sent as."""

from __future__ import annotations

import os

TYPES = {
    ".html": "text/html",
    ".js": "text/javascript",
    ".css": "text/css",
    ".json": "application/json",
    ".wasm": "application/wasm",
    ".woff2": "font/woff2",
    ".png": "image/png",
}


def parts_of(rel: str) -> list[str] | None:
    """A request path's parts under a folder, or None when one is empty, ``.``, ``..`` or
    hidden (nothing outside the folder, nothing hidden in it)."""
    parts = rel.split("/")
    if any(p in ("", ".", "..") or p.startswith(".") for p in parts):
        return None
    return parts


def content_type(name: str, default: str = "application/octet-stream") -> str:
    """The type a file named ``name`` is sent as."""
    return TYPES.get(os.path.splitext(name)[1], default)
