"""The house rules, read from the source: which room may import what, and how long a part may be.

Rooms are the packages by the process their code runs in (see docs/architecture.md). A rule
applies to every module under its prefix; every rule that matches a module must hold.

An import is every ``import`` and ``from ... import`` statement, wherever it is (in a function,
under ``TYPE_CHECKING``), and ``importlib.import_module`` of a literal name. Not seen: the
``__import__`` builtin, ``import_module`` of a computed name, and dotted names in strings that
another program imports (Ray's ``worker_process_setup_hook="worker_ext.attach.setup"``, entry
points): none of those may be used to step around a rule.
"""

from __future__ import annotations

import ast
from collections.abc import Collection
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
        (
            "coordinator.core",
            "coordinator.protocol",
            "coordinator.raylink",
            "coordinator.client",
            "worker_ext",
        ),
        why="a rank and its agent speak to the coordinator through the protocol (and an SPMD "
        "rank's session through the trainer's client, which creates or finds the actor)",
        exempt=("worker_ext.attach",),
    ),
    Rule(
        "worker_ext.attach",
        (
            "coordinator.core.attach",
            "worker_ext.agent.kineto_ipc",
            "worker_ext.rank.attached",
        ),
        ("torch",),
        "Ray's setup hook: the standard library and the config reader (and, for engine "
        "kineto, libkineto's daemon environment, which must be set before torch is imported); "
        "what a process becomes at its first optimizer step (worker_ext.rank.attached) is "
        "imported only then; never trainers, which sit above every worker_ext room (the code a "
        "worker process runs lives in worker_ext)",
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
    for base, names in _imported(name, path):
        found.add(base)
        found.update(f"{base}.{n}" for n in names)
    return found


def _imported(name: str, path: Path) -> list[tuple[str, tuple[str, ...]]]:
    """Each import of module ``name`` anywhere in its file (a function's body, an ``if
    TYPE_CHECKING:`` block, ``importlib.import_module("a")`` with a literal) as the module it
    names and, for ``from a import b, c``, the names taken from it; relative ones resolved."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: list[tuple[str, tuple[str, ...]]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, ()) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            found.append((base, tuple(alias.name for alias in node.names)))
        elif (
            isinstance(node, ast.Call)
            and ast.unparse(node.func) in ("importlib.import_module", "import_module")
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            found.append((node.args[0].value, ()))
    return found


def import_graph(root: Path) -> dict[str, set[str]]:
    """Each module of the project and the project's modules it imports, run-time imports
    included: ``from a import b`` is an arrow to ``a.b`` where that is a module, else to
    ``a``; the packages above an imported module (whose ``__init__`` Python runs first) are
    not arrows, or every module would be in a circle with its package's face."""
    mods = modules(root)
    graph: dict[str, set[str]] = {name: set() for name in mods}
    for name, path in mods.items():
        for base, names in _imported(name, path):
            targets = [f"{base}.{n}" for n in names if f"{base}.{n}" in mods]
            if len(targets) < len(names) or not names:
                targets.append(base)
            for target in targets:
                while target and target not in mods:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph[name].add(target)
    return graph


def circles(graph: dict[str, set[str]]) -> list[str]:
    """Every circle of imports in ``graph``, one line per group of modules that reach each
    other (a strongly connected component): its shortest circle, ``a -> b -> a``, then the
    group's other arrows."""
    out = []
    for group in _strong_groups(graph):
        arrows = {(a, b) for a in group for b in graph[a] if b in group}
        circle = _circle_through(min(group), group, graph)
        rest = sorted(arrows - set(zip(circle, circle[1:], strict=False)))
        more = f" (and {', '.join(f'{a} -> {b}' for a, b in rest)})" if rest else ""
        out.append(" -> ".join(circle) + more)
    return sorted(out)


def _strong_groups(graph: dict[str, set[str]]) -> list[set[str]]:
    """The groups of two or more modules that each reach every other (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while True:
                w = stack.pop()
                group.add(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(group)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return groups


def _circle_through(start: str, group: set[str], graph: dict[str, set[str]]) -> list[str]:
    """The shortest way from ``start`` back to itself inside ``group``."""
    before: dict[str, str] = {}
    todo = [start]
    while todo:
        v = todo.pop(0)
        for w in sorted(graph[v] & group):
            if w == start:
                path = [v]
                while path[-1] != start:
                    path.append(before[path[-1]])
                return [*reversed(path), start]
            if w not in before:
                before[w] = v
                todo.append(w)
    raise AssertionError(f"{start} is in no circle")


def _within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def import_violations(root: Path, allowed: Collection[tuple[str, str]] = ()) -> list[str]:
    """Every import, at the top or inside a function, that breaks a rule, as ``module imports
    X: why``; an ``allowed`` pair ``(module, imported)`` is left out."""
    mods = modules(root)
    out = []
    for name, path in mods.items():
        for imported in sorted(imports(name, path)):
            if any(name == a and _within(imported, b) for a, b in allowed):
                continue
            top = imported.split(".")[0]
            for rule in RULES:
                if not _within(name, rule.room) or any(_within(name, e) for e in rule.exempt):
                    continue
                ours = top in PACKAGES
                may = any(_within(imported, p) for p in rule.may_import)
                if ours and not may and any(_within(imported, m) for m in mods):
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
