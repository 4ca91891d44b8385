import os
import subprocess
import sys

import pytest
from omegaconf import OmegaConf

from coordinator.core.config import ProfilerConfig


def test_disabled_config_validates_without_save_path():
    cfg = ProfilerConfig().validate()
    assert cfg.enable is False and cfg.save_path is None


def test_enabled_config_needs_save_path():
    with pytest.raises(ValueError, match="'save_path' is required"):
        ProfilerConfig(enable=True).validate()


@pytest.mark.subprocess
def test_config_imports_without_torch():
    code = "import sys, coordinator, coordinator.core.config; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize(
    "field,value,pattern",
    [
        ("active", None, r"'active' must be an int, got NoneType: None"),
        ("wait", True, r"'wait' must be an int, got bool: True"),
        ("warmup", "2", r"'warmup' must be an int, got str: '2'"),
        ("skip_first", -1, r"'skip_first' must be >= 0, got -1"),
        ("repeat", -3, r"'repeat' must be >= 0, got -3"),
        ("active", 0, r"'active' must be >= 1, got 0"),
        ("top_k", 0, r"'top_k' must be >= 1, got 0"),
        ("collectives_cap", -1, r"'collectives_cap' must be >= 0, got -1"),
        ("collectives_cap", 10_001, r"'collectives_cap' must be <= 10000, got 10001"),
        ("collectives_cap", None, r"'collectives_cap' must be an int, got NoneType: None"),
        ("enable", None, r"'enable' must be true or false, got NoneType: None"),
        ("with_stack", 1, r"'with_stack' must be true or false, got int: 1"),
        ("ranks", None, r"'ranks' is None"),
        ("ranks", "0,1", r"'ranks' must be a list of ints or 'all', got '0,1'"),
        ("ranks", [], r"'ranks' is empty"),
        ("ranks", [0, -2], r"negative rank -2"),
        ("ranks", [0, True], r"non-int rank True"),
        ("activities", "cpu", r"'activities' must be a list.*got 'cpu'"),
        ("activities", [], r"'activities' is empty"),
        ("activities", ["cpu", "tpu"], r"unknown activity 'tpu'"),
        ("activities", None, r"'activities' must be a list.*got None"),
        ("export_type", "json", r"'export_type' is 'json'"),
        ("run_name", "../escape", r"'run_name' '../escape'"),
        ("run_name", ".hidden", r"'run_name' '.hidden'"),
        ("worker_timeout_s", 0, r"'worker_timeout_s' must be a finite number > 0"),
        ("worker_timeout_s", None, r"'worker_timeout_s' must be a number"),
    ],
)
def test_validate_names_field_and_value(tmp_path, field, value, pattern):
    cfg = ProfilerConfig(enable=True, save_path=str(tmp_path))
    setattr(cfg, field, value)
    with pytest.raises(ValueError, match=pattern):
        cfg.validate()


def test_stacks_export_needs_with_stack(tmp_path):
    with pytest.raises(ValueError, match="needs|need with_stack"):
        ProfilerConfig(enable=True, save_path=str(tmp_path), export_type="stacks").validate()
    ProfilerConfig(
        enable=True, save_path=str(tmp_path), export_type="stacks", with_stack=True
    ).validate()


def test_save_path_that_is_a_file_is_rejected(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(ValueError, match="exists and is not a directory"):
        ProfilerConfig(enable=True, save_path=str(f)).validate()
    with pytest.raises(ValueError, match="cannot be created"):
        ProfilerConfig(enable=True, save_path=str(f / "below")).validate()


def test_unwritable_save_path_is_rejected():
    # /proc/self exists and is a directory that nobody, root included, can create files in.
    with pytest.raises(ValueError, match="is not writable"):
        ProfilerConfig(enable=True, save_path="/proc/self").validate()


def test_missing_save_path_under_writable_dir_is_accepted_and_not_created(tmp_path):
    target = tmp_path / "a" / "b"
    ProfilerConfig(enable=True, save_path=str(target)).validate()
    assert not target.exists()
    assert os.listdir(tmp_path) == []  # the probe file is gone too


def test_from_dict_rejects_unknown_key_with_suggestion():
    with pytest.raises(ValueError, match=r"unknown key 'actve'; did you mean 'active'\?"):
        ProfilerConfig.from_dict({"actve": 2})


def test_from_dict_yaml_null_is_rejected_by_name(tmp_path):
    conf = OmegaConf.create(f"enable: true\nsave_path: {tmp_path}\nwarmup: null\n")
    with pytest.raises(ValueError, match="'warmup' must be an int, got NoneType"):
        ProfilerConfig.from_dict(conf)


def test_from_dict_accepts_omegaconf(tmp_path):
    conf = OmegaConf.create(
        {"enable": True, "save_path": str(tmp_path), "ranks": [1, 0], "activities": ["cpu"]}
    )
    cfg = ProfilerConfig.from_dict(conf)
    assert cfg.ranks == [0, 1] and type(cfg.ranks) is list
    assert cfg.activities == ["cpu"] and type(cfg.activities) is list


def test_from_dict_round_trips_to_dict(tmp_path):
    cfg = ProfilerConfig(enable=True, save_path=str(tmp_path), ranks="all", repeat=0).validate()
    assert ProfilerConfig.from_dict(cfg.to_dict()) == cfg


def test_from_dict_rejects_non_mapping():
    with pytest.raises(ValueError, match="expected a mapping"):
        ProfilerConfig.from_dict(["enable"])


def test_selects():
    assert ProfilerConfig(ranks="all").selects(7)
    cfg = ProfilerConfig(ranks=[0, 2])
    assert cfg.selects(2) and not cfg.selects(1)
