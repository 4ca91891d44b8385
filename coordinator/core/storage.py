"""Where traces end up: a local directory, or an fsspec URL (``s3://``, ``gs://``, ``az://``...).

Pure helpers over path strings and storage options, plus ``filesystem``, the one place that
opens an fsspec filesystem (imported lazily: a local ``save_path`` needs nothing new). Secrets in
``storage_options`` never leave through ``redact``ed views: status, logs, the CLI.
"""

from __future__ import annotations

import os
import re
from typing import Any

LOCAL_PROTOCOLS = ("file", "local")
REDACTED = "<redacted>"
# A storage option whose name says it holds a credential.
_SECRET = re.compile(
    r"(secret|token|password|passwd|credential|key|auth|session|sas|signature)", re.I
)
# Options that are names of places, not secrets, although they match the pattern above.
_NOT_SECRET = {"key_prefix", "endpoint_url", "region_name", "client_kwargs", "config_kwargs"}


def protocol_of(path: str) -> str | None:
    """``s3`` for ``s3://bucket/x``; None for a plain local path."""
    if "://" not in path:
        return None
    return path.split("://", 1)[0].lower() or None


def is_remote(path: str | None) -> bool:
    """Whether ``path`` is a URL of a non-local filesystem."""
    proto = protocol_of(path) if path else None
    return proto is not None and proto not in LOCAL_PROTOCOLS


def local_path(path: str) -> str:
    """``file:///x`` -> ``/x``; a plain path unchanged."""
    proto = protocol_of(path)
    if proto in LOCAL_PROTOCOLS:
        return path.split("://", 1)[1]
    return path


def check_backend(path: str) -> None:
    """ValueError unless fsspec knows ``path``'s protocol and its backend is installed."""
    proto = protocol_of(path)
    if proto is None or proto in LOCAL_PROTOCOLS:
        return
    try:
        import fsspec
    except ImportError:
        raise ValueError(
            f"profiler config: 'save_path' {path!r} is a URL, which needs fsspec "
            "(pip install fsspec)"
        ) from None
    try:
        fsspec.get_filesystem_class(proto)
    except ImportError as exc:  # a known protocol whose package is missing
        raise ValueError(
            f"profiler config: 'save_path' {path!r} needs a package that is not installed: "
            f"{_install_hint(proto, exc)}"
        ) from None
    except ValueError:
        raise ValueError(
            f"profiler config: 'save_path' {path!r} has protocol {proto!r}, which fsspec does not "
            "know (s3://, gs://, az://, file://, or a plain path)"
        ) from None


def _install_hint(proto: str, exc: ImportError) -> str:
    packages = {"s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "az": "adlfs"}
    package = packages.get(proto)
    hint = f"pip install {package}" if package else str(exc)
    return f"{hint} ({exc})" if package and str(exc) else hint


def join(base: str, *parts: str) -> str:
    """``base/part/...`` for a URL or a local path; every part must be one plain component."""
    for p in parts:
        if not p or "/" in p or "\\" in p or p in (".", ".."):
            raise ValueError(f"path component {p!r} is not a single file name")
    if is_remote(base):
        return "/".join([base.rstrip("/"), *parts])
    return os.path.join(base, *parts)


def redact(options: dict[str, Any] | None) -> dict[str, Any]:
    """A copy of ``options`` with every value that may be a credential replaced."""
    out: dict[str, Any] = {}
    for k, v in (options or {}).items():
        if isinstance(v, dict):
            out[k] = redact(v)
        elif str(k) not in _NOT_SECRET and _SECRET.search(str(k)):
            out[k] = REDACTED
        else:
            out[k] = v
    return out


def filesystem(url: str, storage_options: dict[str, Any] | None) -> tuple[Any, str]:
    """The fsspec filesystem for ``url`` and the path inside it."""
    from fsspec.core import url_to_fs

    fs, path = url_to_fs(url, **(storage_options or {}))
    return fs, str(path)
