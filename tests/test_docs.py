"""The docs stay true: every relative link resolves, every config field and reply type is in
the reference, the README stays short, and the public entry points carry their examples."""

import dataclasses
import doctest
import re
from pathlib import Path

import pytest

from coordinator.core.config import ProfilerConfig
from tests.conftest import ROOT

ROOT_PATH = Path(ROOT)
DOCS = sorted(
    [ROOT_PATH / "README.md", ROOT_PATH / "CHANGELOG.md", ROOT_PATH / "bench" / "README.md"]
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


def test_the_docs_link_to_each_other_from_the_readme():
    readme = (ROOT_PATH / "README.md").read_text()
    for doc in ("architecture", "reference", "operations", "reliability"):
        assert f"(docs/{doc}.md)" in readme
    assert "(bench/README.md)" in readme


def test_the_readme_is_at_most_200_lines():
    assert len((ROOT_PATH / "README.md").read_text().splitlines()) <= 200


def test_every_config_field_is_in_the_reference():
    reference = (ROOT_PATH / "docs" / "reference.md").read_text()
    missing = [f.name for f in dataclasses.fields(ProfilerConfig) if f"`{f.name}`" not in reference]
    assert missing == []


def test_every_reply_type_is_named_in_the_reference():
    from coordinator.protocol import replies

    reference = (ROOT_PATH / "docs" / "reference.md").read_text()
    declared = [n for n, v in vars(replies).items() if n.endswith("Reply") and isinstance(v, type)]
    assert declared and [n for n in declared if f"`{n}`" not in reference] == []


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
    ("coordinator.client.attach", "get_or_create_coordinator"),
    ("coordinator.client.attach", "connect"),
    ("coordinator.service.actor", "_Coordinator.status"),
    ("coordinator.service.actor", "_Coordinator.kernel_summary"),
    ("coordinator.service.actor", "_Coordinator.request_capture"),
    ("coordinator.ops.collect", "collect_window"),
    ("coordinator.ops.timeline", "merge_window"),
    ("coordinator.ops.timeline", "write_timeline"),
    ("coordinator.core.config", "ProfilerConfig"),
    ("coordinator.core.config", "ProfilerConfig.from_dict"),
    ("trainers.rank_session", "RankSession.attach"),
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
        "coordinator.client.attach",
        "coordinator.client.phase_buffer",
        "coordinator.client.phase_clock",
        "coordinator.client.rank_reports",
        "coordinator.core.window_plan",
        "trainers.hooks",
        "trainers.rank_session",
    ],
)
def test_the_examples_that_need_no_cluster_run(module):
    import importlib

    failed, attempted = doctest.testmod(
        importlib.import_module(module), optionflags=doctest.ELLIPSIS
    )
    assert attempted > 0 and failed == 0
