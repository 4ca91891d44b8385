"""The house rules hold: rooms import only what they may, parts stay short, and the rank RPCs
are declared once in the protocol and implemented by the mixin."""

import inspect
import shutil
from pathlib import Path

from tests.conftest import ROOT
from tests.house_rules import (
    PACKAGES,
    ROOMS,
    RULES,
    circles,
    import_graph,
    import_violations,
    long_parts,
    outside_rooms,
    profiler_users,
    renamers,
)

ROOT_PATH = Path(ROOT)


def test_every_room_imports_only_what_it_may():
    assert import_violations(ROOT_PATH) == []


def test_no_circle_of_imports():
    # Run-time imports (inside a function, under TYPE_CHECKING) count: a circle among them
    # is a circle in the design, even where Python's import order happens to survive it.
    assert circles(import_graph(ROOT_PATH)) == []


def test_the_circle_check_sees_a_circle_closed_inside_a_function(tmp_path):
    for package in PACKAGES:
        shutil.copytree(ROOT_PATH / package, tmp_path / package)
    core = tmp_path / "coordinator" / "core"
    (core / "left.py").write_text("from .right import X\n\nY = X\n")
    (core / "right.py").write_text("X = 1\n\n\ndef f():\n    from coordinator.core import left\n")
    assert circles(import_graph(tmp_path)) == [
        "coordinator.core.left -> coordinator.core.right -> coordinator.core.left"
    ]


def test_a_circle_is_said_with_every_other_arrow_of_its_group():
    graph = {"a": {"b"}, "b": {"a"}, "c": set()}
    assert circles(graph) == ["a -> b -> a"]
    graph["c"] = {"a"}  # a third module joins the circle
    graph["b"].add("c")
    assert circles(graph) == ["a -> b -> a (and b -> c, c -> a)"]
    assert circles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_the_check_fails_when_worker_ext_reaches_up_into_trainers_at_run_time(tmp_path):
    for package in PACKAGES:
        shutil.copytree(ROOT_PATH / package, tmp_path / package)
    (tmp_path / "worker_ext" / "rank" / "peek.py").write_text(
        "def f():\n    from trainers import ProfilingHooks\n"
    )
    found = import_violations(tmp_path)
    assert {v.split(":")[0] for v in found} == {
        "worker_ext.rank.peek imports trainers",
        "worker_ext.rank.peek imports trainers.ProfilingHooks",
    }


def test_no_function_over_60_lines_and_no_class_over_300():
    assert long_parts(ROOT_PATH) == []


def test_every_module_is_in_a_room():
    assert outside_rooms(ROOT_PATH) == []
    # Every room falls under a rule (its own or its package's).
    for room in ROOMS:
        assert any(room == r.room or room.startswith(r.room + ".") for r in RULES), room


def test_the_room_check_sees_a_module_beside_the_rooms(tmp_path):
    for package in PACKAGES:
        shutil.copytree(ROOT_PATH / package, tmp_path / package)
    (tmp_path / "coordinator" / "helpers.py").write_text("X = 1\n")
    (tmp_path / "worker_ext" / "util").mkdir()
    (tmp_path / "worker_ext" / "util" / "__init__.py").write_text("")
    assert outside_rooms(tmp_path) == ["coordinator.helpers", "worker_ext.util"]


def test_the_check_fails_when_a_pure_module_imports_the_service(tmp_path):
    for package in PACKAGES:
        shutil.copytree(ROOT_PATH / package, tmp_path / package)
    schedule = tmp_path / "coordinator" / "core" / "schedule.py"
    schedule.write_text(schedule.read_text() + "\nfrom coordinator.service import shell\n")
    pure = tmp_path / "coordinator" / "protocol" / "replies.py"
    pure.write_text(pure.read_text() + "\ndef f():\n    import ray\n")
    found = import_violations(tmp_path)
    assert any(v.startswith("coordinator.core.schedule imports coordinator.service") for v in found)
    assert any(v.startswith("coordinator.protocol.replies imports ray") for v in found)


def test_the_check_fails_when_the_coordinator_imports_worker_ext(tmp_path):
    for package in PACKAGES:
        shutil.copytree(ROOT_PATH / package, tmp_path / package)
    rank_calls = tmp_path / "coordinator" / "service" / "rank_calls.py"
    rank_calls.write_text(rank_calls.read_text() + "\nfrom worker_ext.rank import mixin\n")
    assert any(
        v.startswith("coordinator.service.rank_calls imports worker_ext")
        for v in import_violations(tmp_path)
    )


def test_the_length_check_sees_a_long_function(tmp_path):
    for package in PACKAGES:
        shutil.copytree(ROOT_PATH / package, tmp_path / package)
    body = "".join(f"    x{i} = {i}\n" for i in range(61))
    (tmp_path / "coordinator" / "core" / "long.py").write_text(f"def long():\n{body}")
    assert long_parts(tmp_path) == ["coordinator.core.long.long: a function of 62 lines"]


def test_the_mixin_implements_the_rank_rpcs_with_their_signatures():
    from coordinator.protocol.rank_rpc import RANK_RPCS, RankRPC
    from coordinator.raylink.handle_stubs import ForeignActorStub as ProfilerWorkerStub
    from worker_ext import ProfilerWorkerMixin

    def params(cls, name):
        # (Ray's tracing adds ``_ray_trace_ctx`` to the methods of a class once it is remote.)
        found = inspect.signature(getattr(cls, name)).parameters.values()
        return [(p.name, p.default) for p in found if p.name != "_ray_trace_ctx"]

    assert issubclass(ProfilerWorkerMixin, RankRPC) and issubclass(ProfilerWorkerStub, RankRPC)
    for name in RANK_RPCS:
        assert params(RankRPC, name) == params(ProfilerWorkerMixin, name), name
        assert name not in vars(ProfilerWorkerStub), name  # the stub only inherits them


def test_the_node_agent_implements_the_agent_rpcs_with_their_signatures():
    from coordinator.protocol.agent_rpc import AgentRPC
    from coordinator.raylink.handle_stubs import ForeignActorStub
    from worker_ext.agent.node_agent import NodeAgent

    def params(cls, name):
        found = inspect.signature(getattr(cls, name)).parameters.values()
        return [(p.name, p.default) for p in found if p.name != "_ray_trace_ctx"]

    assert issubclass(NodeAgent, AgentRPC) and issubclass(ForeignActorStub, AgentRPC)
    for name in ("ping", "command"):
        assert params(NodeAgent, name) == params(AgentRPC, name), name


def test_the_public_names_keep_working():
    from importlib.metadata import entry_points

    from coordinator import ProfilerConfig, connect, get_or_create_coordinator
    from coordinator.__main__ import main as module_main  # python -m coordinator
    from trainers import ProfilingHooks
    from worker_ext import ProfilerWorkerMixin

    assert ProfilerConfig and connect and get_or_create_coordinator
    assert ProfilingHooks and ProfilerWorkerMixin
    (script,) = [e for e in entry_points(group="console_scripts") if e.name == "ray-profiler"]
    assert script.load() is module_main


def test_no_async_method_makes_a_blocking_call():
    from tests.house_rules import blocking_calls_in_async

    assert blocking_calls_in_async(ROOT_PATH) == []


def test_the_blocking_check_sees_a_ray_get_in_an_async_method(tmp_path):
    from tests.house_rules import blocking_calls_in_async

    for package in PACKAGES:
        shutil.copytree(ROOT_PATH / package, tmp_path / package)
    (tmp_path / "worker_ext" / "agent" / "slow.py").write_text(
        "import ray\n\nasync def f(h):\n    return ray.get(h.ping.remote())\n"
    )
    assert blocking_calls_in_async(tmp_path) == ["worker_ext.agent.slow.f: ray.get"]


def test_only_the_rank_s_torch_session_drives_torch_profiler():
    # The product's one driver of torch.profiler, with every guard of torch-profiler-facts.md;
    # the reference trainers' engine stands in for vLLM's and SGLang's, which run their own.
    assert sorted(profiler_users(ROOT_PATH)) == [
        "trainers.reference.engine",
        "worker_ext.rank.rank_profiler",
        "worker_ext.rank.torch_session",
    ]


def test_one_module_renames_a_written_file_into_place():
    # (issue 46, item 17: seven copies of "temporary file, then os.replace", each with a
    # predictable temporary name written through a planted link)
    assert renamers(ROOT_PATH) == ["coordinator.protocol.atomic_file"]


def test_the_rename_check_sees_a_new_copy(tmp_path):
    (tmp_path / "worker_ext").mkdir()
    (tmp_path / "worker_ext" / "save.py").write_text("import os\nos.rename('a', 'b')\n")
    assert renamers(tmp_path) == ["worker_ext.save"]


def test_the_profiler_check_sees_a_new_user(tmp_path):
    for package in PACKAGES:
        shutil.copytree(ROOT_PATH / package, tmp_path / package)
    (tmp_path / "coordinator" / "ops" / "peek.py").write_text(
        "def f(torch):\n    return torch.profiler.profile()\n"
    )
    assert "coordinator.ops.peek" in profiler_users(tmp_path)
