"""The docs stay true: every relative link resolves, the generated reference equals what the
code says (every config field, command, flag and reply), no page is too long to finish, and the
public entry points carry their examples."""

import argparse
import ast
import dataclasses
import doctest
import re
from pathlib import Path

import pytest

from coordinator.core.config import SECTIONS, ProfilerConfig
from coordinator.ops import cli, reference
from tests.conftest import ROOT

ROOT_PATH = Path(ROOT)
DOCS = sorted(
    [ROOT_PATH / "README.md", ROOT_PATH / "CHANGELOG.md"]
    + list((ROOT_PATH / "bench").glob("*.md"))
    + list((ROOT_PATH / "docs").glob("*.md"))
)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def anchors(path: Path) -> set[str]:
    """GitHub's anchors for the headings of a markdown file."""
    out = set()
    for line in path.read_text().splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            out.add(re.sub(r"[^a-z0-9 _-]", "", title).replace(" ", "-"))
    return out


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT_PATH)))
def test_every_relative_link_resolves(doc):
    broken = []
    for target in LINK.findall(doc.read_text()):
        if "://" in target or target.startswith("mailto:"):
            continue
        file, _, anchor = target.partition("#")
        path = (doc.parent / file).resolve() if file else doc
        if not path.exists():
            broken.append(f"{target}: no file {path}")
        elif anchor and path.suffix == ".md" and anchor not in anchors(path):
            broken.append(f"{target}: no heading #{anchor} in {path.name}")
    assert broken == []


def test_the_readme_links_every_page_of_the_docs():
    readme = (ROOT_PATH / "README.md").read_text()
    pages = sorted(p.name for p in (ROOT_PATH / "docs").glob("*.md"))
    assert [p for p in pages if f"(docs/{p})" not in readme] == []
    assert "(bench/README.md)" in readme


def test_the_readme_is_at_most_250_lines():
    assert len((ROOT_PATH / "README.md").read_text().splitlines()) <= 250


PAGES = [ROOT_PATH / "README.md"] + sorted(
    [*(ROOT_PATH / "bench").glob("*.md"), *(ROOT_PATH / "docs").glob("*.md")]
)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT_PATH)))
def test_no_page_is_over_600_lines(page):
    assert len(page.read_text().splitlines()) <= 600


def test_the_benchmarks_page_holds_commands_and_latest_figures_only():
    assert len((ROOT_PATH / "bench" / "README.md").read_text().splitlines()) < 400


@pytest.mark.parametrize("page", sorted(reference.PAGES))
def test_the_reference_is_what_the_code_generates(page, monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")  # --address's default must not leak in
    written = (ROOT_PATH / "docs" / page).read_text()
    assert written == reference.PAGES[page](), (
        f"docs/{page} differs from the code: run make reference"
    )


def test_every_config_field_is_in_the_reference():
    text = (ROOT_PATH / "docs" / "reference.md").read_text()
    names = [f.name for f in dataclasses.fields(ProfilerConfig)]
    names += [
        f"{section}.{f.name}" for section, cls in SECTIONS.items() for f in dataclasses.fields(cls)
    ]
    assert [n for n in names if f"| `{n}` |" not in text] == []


def test_a_rule_says_the_limit_not_the_value_it_was_probed_with():
    text = (ROOT_PATH / "docs" / "reference.md").read_text()
    rows = [r for r in text.splitlines() if r.startswith("| `")]
    assert [r for r in rows if str(2**63) in r] == []
    limited = [r.split("`")[1] for r in rows if r.endswith("; must be at most 2**62 steps |")]
    assert limited == ["skip_first", "wait", "warmup", "active", "repeat", "max_capture_steps"]


def test_every_command_and_flag_is_in_the_reference():
    text = (ROOT_PATH / "docs" / "reference.md").read_text()
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    missing = [c for c in sub.choices if f"### `ray-profiler {c}`" not in text]
    every = text.split("## The command line")[1].split("\n### ")[0]  # what every command takes
    for name, command in sub.choices.items():
        section = text.split(f"### `ray-profiler {name}`")[1].split("\n### ")[0]
        flags = [o for a in command._actions for o in a.option_strings if o not in ("-h", "--help")]
        missing += [f"{name} {o}" for o in flags if f"`{o}`" not in section + every]
    assert sub.choices and missing == []


def test_every_reply_type_is_in_the_replies_page():
    text = (ROOT_PATH / "docs" / "replies.md").read_text()
    declared = [
        name for module in reference.reply_modules() for name, _ in reference._declared(module)
    ]
    assert len(declared) > 50 and [n for n in declared if f"### `{n}`" not in text] == []


def test_every_protocol_module_that_declares_a_typeddict_is_on_the_replies_page():
    # read from the source, not from the generator: a module its search misses fails here
    text = (ROOT_PATH / "docs" / "replies.md").read_text()
    declaring = []
    for path in sorted((ROOT_PATH / "coordinator" / "protocol").glob("*.py")):
        tree = ast.parse(path.read_text())
        classes = [c for c in tree.body if isinstance(c, ast.ClassDef)]
        typed = [c.name for c in classes if "TypedDict" in {ast.unparse(b) for b in c.bases}]
        if typed:
            declaring.append(path.stem)
            assert f"## `coordinator.protocol.{path.stem}`" in text, path.stem
            assert [n for n in typed if f"### `{n}`" not in text] == [], path.stem
    assert {"replies", "collective_replies", "timeline"} <= set(declaring)


def test_the_glossary_names_the_window_lifecycle_words():
    architecture = (ROOT_PATH / "docs" / "architecture.md").read_text()
    glossary = architecture[architecture.index("## Glossary") :]
    for word in ("start / step / stop", "open / closed", "phase", "lifecycle", "pending", "agent"):
        assert f"| {word} |" in glossary, word


PUBLIC = [
    ("trainers.hooks", "ProfilingHooks.attach"),
    ("trainers.hooks", "ProfilingHooks.session"),
    ("trainers.hooks", "ProfilingHooks.step"),
    ("trainers.hooks", "ProfilingHooks.astep"),
    ("coordinator.client.connect", "get_or_create_coordinator"),
    ("coordinator.client.connect", "connect"),
    ("coordinator.service.actor", "_Coordinator.status"),
    ("coordinator.service.actor", "_Coordinator.kernel_summary"),
    ("coordinator.service.actor", "_Coordinator.request_capture"),
    ("coordinator.ops.collect", "collect_window"),
    ("coordinator.ops.timeline", "merge_window"),
    ("coordinator.ops.timeline", "write_timeline"),
    ("coordinator.core.config", "ProfilerConfig"),
    ("coordinator.core.config", "ProfilerConfig.from_dict"),
    ("worker_ext.rank.rank_session", "RankSession.attach"),
]


@pytest.mark.parametrize("module,name", PUBLIC)
def test_public_entry_points_say_what_they_take_return_and_raise(module, name):
    import importlib

    obj = importlib.import_module(module)
    for part in name.split("."):
        obj = getattr(obj, part)
    doc = obj.__doc__ or ""
    assert "Example" in doc, name
    if name != "ProfilerConfig":  # its fields carry their own docstrings
        assert "Args:" in doc or "Returns:" in doc, name


@pytest.mark.parametrize(
    "module",
    [
        "coordinator.core.config",
        "coordinator.core.validate",
        "coordinator.core.timeline",
        "coordinator.core.step_series",
        "coordinator.ops.run_chart",
        "coordinator.core.trackers_config",
        "coordinator.core.tracker_figures",
        "coordinator.client.connect",
        "coordinator.client.phase_buffer",
        "coordinator.client.phase_clock",
        "coordinator.client.rank_reports",
        "coordinator.core.window_plan",
        "trainers.hooks",
        "worker_ext.rank.rank_session",
    ],
)
def test_the_examples_that_need_no_cluster_run(module):
    import importlib

    failed, attempted = doctest.testmod(
        importlib.import_module(module), optionflags=doctest.ELLIPSIS
    )
    assert attempted > 0 and failed == 0
