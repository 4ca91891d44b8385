"""The house rules, read from the source: which room may import what, and how long a part may be.

Rooms are the packages by the process their code runs in (see docs/architecture.md). A rule
applies to every module under its prefix; every rule that matches a module must hold.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

PACKAGES = ("coordinator", "worker_ext", "trainers")
MAX_FUNCTION_LINES = 60
MAX_CLASS_LINES = 300


@dataclass(frozen=True)
class Rule:
    room: str
    """The modules the rule is about (a package prefix)."""
    may_import: tuple[str, ...]
    """The project's packages they may import; every other one of the project is refused."""
    never: tuple[str, ...] = ()
    """Third-party packages they must not import, not even inside a function."""
    why: str = ""
    exempt: tuple[str, ...] = ()
    """Modules under ``room`` that the rule does not cover (each has a rule of its own)."""


PURE = "pure: runs anywhere, imports neither Ray nor torch"
RULES = (
    Rule("coordinator.protocol", ("coordinator.protocol",), ("ray", "torch"), PURE),
    Rule("coordinator.core", ("coordinator.core", "coordinator.protocol"), ("ray", "torch"), PURE),
    Rule(
        "coordinator",
        ("coordinator", "worker_ext.agent"),
        ("torch",),
        "the coordinator never loads torch; of worker_ext only the operator's tools may read "
        "traces with the node agent's reader (ray-profiler summarise), and every other room "
        "of the coordinator has a rule of its own that refuses it",
    ),
    Rule(
        "coordinator.raylink",
        ("coordinator.protocol", "coordinator.raylink"),
        why="Ray glue shared by the coordinator and the node agents: the protocol, nothing else",
    ),
    Rule(
        "coordinator.service",
        ("coordinator.core", "coordinator.protocol", "coordinator.raylink", "coordinator.service"),
        why="the actor never imports the trainer's or the operator's rooms",
    ),
    Rule(
        "coordinator.client",
        ("coordinator.core", "coordinator.protocol", "coordinator.client", "coordinator.service"),
        why="the trainer's process reaches the actor, never the operator's tools",
    ),
    Rule(
        "worker_ext",
        ("coordinator.core", "coordinator.protocol", "coordinator.raylink", "worker_ext"),
        why="a rank and its agent speak to the coordinator only through the protocol",
        exempt=("worker_ext.attach",),
    ),
    Rule(
        "worker_ext.attach",
        ("trainers.attach_hook", "coordinator.core.attach", "worker_ext.agent.kineto_ipc"),
        ("torch",),
        "Ray's setup hook: the standard library and the config reader (and, for engine "
        "kineto, libkineto's daemon environment, which must be set before torch is imported) "
        "until the first optimizer step, then the attach hook, which attaches the process as a "
        "user's loop would",
    ),
    Rule(
        "worker_ext.agent",
        ("coordinator.core", "coordinator.protocol", "coordinator.raylink", "worker_ext.agent"),
        ("torch",),
        "the node agent reads traces; it never loads torch or the rank's code",
    ),
    Rule(
        "trainers",
        ("coordinator", "worker_ext", "trainers"),
        why="trainers use the project; nothing of the project imports trainers",
    ),
)


ROOMS = (
    "coordinator.core",
    "coordinator.protocol",
    "coordinator.raylink",
    "coordinator.service",
    "coordinator.client",
    "coordinator.ops",
    "worker_ext.rank",
    "worker_ext.agent",
    "trainers",
)
"""The rooms of docs/architecture.md, each a package whose modules run in one kind of process."""
FACADES = ("coordinator", "coordinator.__main__", "worker_ext", "worker_ext.attach")
"""The packages' public faces: re-exports, ``python -m coordinator`` and the setup hook Ray
names (``worker_ext.attach.setup``), in no room."""


def outside_rooms(root: Path) -> list[str]:
    """Every module in no room (``ROOMS``) that is not a package's face (``FACADES``): a module
    added beside the rooms, whose process, and so its rules, nobody has said."""
    return [
        name
        for name in modules(root)
        if name not in FACADES and not any(_within(name, room) for room in ROOMS)
    ]


def modules(root: Path) -> dict[str, Path]:
    """Every module of the project's packages under ``root``, by dotted name."""
    out = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def imports(name: str, path: Path) -> set[str]:
    """Every module ``name`` imports, at the top or inside a function, as dotted names (a
    ``from a import b`` counts as ``a`` and ``a.b``)."""
    found: set[str] = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def _within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def import_violations(root: Path) -> list[str]:
    """Every import that breaks a rule, as ``module imports X: why``."""
    mods = modules(root)
    out = []
    for name, path in mods.items():
        for imported in sorted(imports(name, path)):
            top = imported.split(".")[0]
            for rule in RULES:
                if not _within(name, rule.room) or any(_within(name, e) for e in rule.exempt):
                    continue
                ours = top in PACKAGES
                allowed = any(_within(imported, p) for p in rule.may_import)
                if ours and not allowed and any(_within(imported, m) for m in mods):
                    out.append(f"{name} imports {imported}: {rule.why or rule.room}")
                if not ours and top in rule.never:
                    out.append(f"{name} imports {imported}: {rule.why}")
    return sorted(set(out))


def long_parts(root: Path) -> list[str]:
    """Every function over ``MAX_FUNCTION_LINES`` and class over ``MAX_CLASS_LINES`` lines."""
    out = []
    for name, path in modules(root).items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = (node.end_lineno or node.lineno) - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    out.append(f"{name}.{node.name}: a function of {n} lines")
            elif isinstance(node, ast.ClassDef):
                n = (node.end_lineno or node.lineno) - node.lineno + 1
                if n > MAX_CLASS_LINES:
                    out.append(f"{name}.{node.name}: a class of {n} lines")
    return out


PROFILER_APIS = ("torch.profiler", "torch.autograd.profiler")


def profiler_users(root: Path) -> list[str]:
    """Every module that imports or calls ``torch.profiler`` (or the autograd profiler)."""
    out = []
    for name, path in modules(root).items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            used = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else [ast.unparse(node)]
                if isinstance(node, ast.Attribute)
                else []
            )
            if any(_within(u, api) for u in used for api in PROFILER_APIS):
                out.append(name)
                break
    return out


def renamers(root: Path) -> list[str]:
    """Every module that calls ``os.replace`` or ``os.rename``: a file written beside its final
    name and renamed into place, which ``coordinator.protocol.atomic_file`` alone does."""
    out = []
    for name, path in modules(root).items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Attribute) and ast.unparse(node) in ("os.replace", "os.rename"):
                out.append(name)
                break
    return out


BLOCKING = ("ray.get", "ray.get_actor", "ray.wait", "ray.kill", "time.sleep")


def blocking_calls_in_async(root: Path) -> list[str]:
    """Every blocking call (``BLOCKING``, or a Ray KV call) written inside an ``async def`` of
    the project (not inside a plain function nested in it): it would stall that event loop."""
    out = []
    for name, path in modules(root).items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.AsyncFunctionDef):
                out += [f"{name}.{node.name}: {call}" for call in _calls_in(node)]
    return out


def _calls_in(fn: ast.AsyncFunctionDef) -> list[str]:
    found = []
    todo: list[ast.AST] = list(fn.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue  # its own body runs elsewhere (an executor, a callback)
        if isinstance(node, ast.Call):
            called = ast.unparse(node.func)
            if called in BLOCKING or "_internal_kv_" in called:
                found.append(called)
        todo.extend(ast.iter_child_nodes(node))
    return found
