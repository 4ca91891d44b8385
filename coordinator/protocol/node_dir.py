"""The one private directory per user and node for every node-local file the profiler makes.

Plan boards, stack dumps, memory notes and pipes, kineto's sockets: each lives in a folder of
``<tmp>/ray-profiler-<uid>/`` (``node_dir("plans")``, ...), where ``<uid>`` is the user's own
id, so two users of a node never share a folder. The uid is public: another user can create
that path first. So every component we create is checked before use (``private_dir``): a
directory, not a link, owned by this user, mode 0700. A check that fails is a PermissionError
that says what to do; nothing is written there.

``$RAY_PROFILER_NODE_DIR`` moves the whole tree; a folder's own variable
(``$RAY_PROFILER_PLANS_DIR``, ...) moves that folder (``chosen_dir``). Either is checked the same
way: every component made by us, and the folder itself.
"""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from pathlib import Path

NODE_DIR_ENV = "RAY_PROFILER_NODE_DIR"


def user_root() -> Path:
    """This user's directory on this node: ``$RAY_PROFILER_NODE_DIR``, else
    ``<tmp>/ray-profiler-<uid>``. Not created or checked (``node_dir`` does both)."""
    chosen = os.environ.get(NODE_DIR_ENV)
    return Path(chosen) if chosen else Path(tempfile.gettempdir()) / f"ray-profiler-{os.getuid()}"


def private_dir(
    path: Path, what: str = "the profiler's directory", env: str = NODE_DIR_ENV
) -> Path:
    """``path``, a directory private to this user: made with mode 0700 when missing.

    Raises:
        PermissionError: it is a link or not a directory, belongs to another user, or is open
            to others (a file planted there would reach this user's ranks); the message names
            ``what`` it is and the variable ``env`` that moves it.
    """
    with contextlib.suppress(FileExistsError):
        path.mkdir(mode=0o700)
    st = os.lstat(path)
    why = (
        "is a link or not a directory"
        if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode)
        else f"belongs to uid {st.st_uid}, not this user's ({os.getuid()})"
        if st.st_uid != os.getuid()
        else f"has mode {stat.S_IMODE(st.st_mode):04o}, open to others"
        if st.st_mode & 0o077
        else None
    )
    if why is not None:
        raise PermissionError(
            f"{what} {path} {why}: refused (another user could plant files there or read "
            f"this user's); remove it, or set {env} to a directory of your own with mode 0700"
        )
    return path


def private_tree(path: Path, what: str, env: str) -> Path:
    """``path`` as ``private_dir`` makes it, and each of its missing parents likewise: every
    component we create is ours and checked, not only the leaf (a parent made first by another
    user could swap the leaf for its own)."""
    missing = []
    up = path
    while not os.path.lexists(up) and up != up.parent:
        missing.append(up)
        up = up.parent
    for part in reversed(missing):
        private_dir(part, what, env)
    return private_dir(path, what, env)


def node_dir(*parts: str, what: str = "the profiler's directory", env: str = NODE_DIR_ENV) -> Path:
    """``user_root()/<parts...>``, each component made (0700) and checked (``private_dir``);
    a refusal names ``what`` the folder is, and ``env``, the variable that moves it (the
    root's: ``$RAY_PROFILER_NODE_DIR``)."""
    path = private_tree(user_root(), what, NODE_DIR_ENV)
    for part in parts:
        if not part or "/" in part or part in (".", ".."):
            raise ValueError(f"{part!r} is not a folder name")
        path = private_dir(path / part, what, env)
    return path


def chosen_dir(env: str, part: str, what: str) -> Path:
    """The folder ``$env`` names (made and checked as ``private_tree`` does), else
    ``node_dir(part)``."""
    chosen = os.environ.get(env)
    return private_tree(Path(chosen), what, env) if chosen else node_dir(part, what=what, env=env)
