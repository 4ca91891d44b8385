"""``raylink/handles``'s private Ray path on a Ray other than the tested one (a fault injected
for each): an ``ActorHandle`` message without a field we set is built without it, never refused
with protobuf's "no field"; a failure of the private path names this Ray's version."""

from __future__ import annotations

from typing import Any

import pytest
import ray
from ray.core.generated import common_pb2, core_worker_pb2, gcs_pb2

from coordinator.raylink import handles

ACTOR_HEX = "ab" * 16
HANDLE = core_worker_pb2.ActorHandle  # (this Ray's own message)


def _entry() -> gcs_pb2.ActorTableData:
    """An unnamed Python actor's entry of Ray's actor table, with a label."""
    entry = gcs_pb2.ActorTableData(
        actor_id=bytes.fromhex(ACTOR_HEX),
        job_id=bytes.fromhex("01000000"),
        ray_namespace="ns",
        labels={"zone": "a"},
        state=gcs_pb2.ActorTableData.ALIVE,
    )
    entry.function_descriptor.python_function_descriptor.class_name = "Rank"
    return entry


class _HandleWithout:
    """Ray's ``ActorHandle`` message as a Ray that lacks ``missing`` has it: its descriptor
    does not list it, and a message given it is refused as protobuf refuses an unknown field."""

    missing = "labels"

    class DESCRIPTOR:  # noqa: N801 (protobuf's name)
        fields_by_name = {
            k: v for k, v in HANDLE.DESCRIPTOR.fields_by_name.items() if k != "labels"
        }

    def __new__(cls, **fields: Any) -> Any:
        if cls.missing in fields:
            raise ValueError(f'Protocol message ActorHandle has no "{cls.missing}" field.')
        return HANDLE(**fields)


def test_a_handle_field_this_ray_lacks_is_left_out_and_the_others_set(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    built = HANDLE.FromString(handles._from_table(_entry()))
    assert dict(built.labels) == {"zone": "a"} and built.enable_task_events
    monkeypatch.setattr(core_worker_pb2, "ActorHandle", _HandleWithout)
    older = HANDLE.FromString(handles._from_table(_entry()))
    assert not older.labels  # (left out: this "Ray" has no such field)
    assert older.max_pending_calls == -1 and older.enable_task_events
    assert older.actor_id.hex() == ACTOR_HEX and older.ray_namespace == "ns"
    assert older.actor_language == common_pb2.Language.PYTHON
    assert set(handles.OPTIONAL_FIELDS) <= set(HANDLE.DESCRIPTOR.fields_by_name)


def test_a_failure_of_ray_s_private_path_names_ray_s_version(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def moved(*args: object) -> None:  # (as if a Ray had moved or renamed it)
        raise AttributeError("'GlobalState' object has no attribute 'get_actor_info'")

    monkeypatch.setattr(ray._private.state.state, "get_actor_info", moved)
    got, why = handles.load_handles([ACTOR_HEX])
    assert got == {} and list(why) == [ACTOR_HEX]
    assert why[ACTOR_HEX].startswith("PrivateApiFailed: ")
    assert f"Ray {ray.__version__}'s private actor-table API failed" in why[ACTOR_HEX]
    assert f"tested with Ray {handles.TESTED_RAY}" in why[ACTOR_HEX]
    assert "no attribute 'get_actor_info'" in why[ACTOR_HEX]


def test_an_actor_the_table_does_not_have_is_not_blamed_on_ray_s_version(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(ray._private.state.state, "get_actor_info", lambda actor: None)
    _, why = handles.load_handles([ACTOR_HEX])
    assert why[ACTOR_HEX] == "LookupError: Ray's actor table has no such actor"
