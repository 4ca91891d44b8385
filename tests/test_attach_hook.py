"""The setup hook inside one process (no Ray): it leaves torch alone until the training code
imports it, registers one optimizer hook, and never lets a fault, a bad config, a fork or an
unreachable coordinator reach ``optimizer.step()``. Each case runs in a subprocess of its own:
a hook that broke the process fails the test instead of the run."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap

import pytest

pytestmark = pytest.mark.subprocess
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TRAIN = """
import json, torch
torch.manual_seed(0)
model = torch.nn.Linear(8, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
losses = []
for _ in range(6):
    loss = model(torch.ones(4, 8)).pow(2).mean()
    opt.zero_grad(); loss.backward(); opt.step(); losses.append(loss.item())
print("LOSSES", json.dumps(losses))
"""


def run(
    code: str, config: str | None = None, setup: bool = True, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "RAY_PROFILER_CONFIG"} | (env or {})
    env["PYTHONPATH"] = ROOT
    if config is not None:
        env["RAY_PROFILER_CONFIG"] = config
    head = "from worker_ext.attach import setup\nsetup()\n" if setup else ""
    return subprocess.run([sys.executable, "-c", head + textwrap.dedent(code)], env=env,
                          capture_output=True, text=True, timeout=120, cwd=ROOT)  # fmt: skip


def losses(proc: subprocess.CompletedProcess) -> list[float]:
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("LOSSES"))
    return json.loads(line.split(" ", 1)[1])


def test_setup_leaves_torch_alone_until_the_training_code_imports_it():
    proc = run("""
        import sys, threading
        assert "torch" not in sys.modules, "setup imported torch"
        assert threading.active_count() == 1, threading.enumerate()  # (no thread either)
        setup()  # (twice: still one hook)
        import torch
        from torch.optim.optimizer import _global_optimizer_post_hooks as hooks
        from worker_ext.attach import on_optimizer_step
        assert list(hooks.values()) == [on_optimizer_step], hooks
        from worker_ext.attach import SKYRL_PROFILER
        watches = [f.waiting for f in sys.meta_path if type(f).__name__ == "_ImportWatch"]
        assert [list(w) for w in watches] == [[SKYRL_PROFILER]], watches  # (torch's seen)
        print("OK")
    """)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-3000:]


def test_setup_after_torch_was_imported_registers_at_once():
    proc = run("""
        import torch
        from worker_ext.attach import setup, on_optimizer_step
        setup()
        from torch.optim.optimizer import _global_optimizer_post_hooks as hooks
        assert list(hooks.values()) == [on_optimizer_step], hooks
        print("OK")
    """, setup=False)  # fmt: skip
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-3000:]


@pytest.mark.parametrize(
    ("config", "says"),
    [
        ("{enable: [", "not valid YAML"),
        (None, "RAY_PROFILER_CONFIG is not set"),
        ("/nowhere/profiler.yaml", "cannot be read"),
        ("{enable: true, warmup: null, save_path: /tmp}", "'warmup' must be an int"),
    ],
)
def test_a_bad_config_is_one_error_and_the_training_goes_on(config, says):
    plain = losses(run(TRAIN, setup=False))
    proc = run(TRAIN, config)
    assert losses(proc) == plain  # bit-identical, every step ran
    errors = [x for x in proc.stderr.splitlines() if "is not profiled" in x]
    assert len(errors) == 1 and says in errors[0], proc.stderr[-3000:]


def test_a_disabled_config_touches_nothing():
    proc = run(TRAIN, "{enable: false}")
    assert losses(proc) == losses(run(TRAIN, setup=False)) and "profiler" not in proc.stderr


def test_a_fault_in_the_hook_never_leaves_the_optimizer_step():
    proc = run(
        textwrap.dedent("""
        import worker_ext.rank.attached as hook
        def broken(optimizer):
            raise RuntimeError("injected")
        hook.first_step = broken
        """)
        + TRAIN,
        "{enable: true}",
    )
    assert len(losses(proc)) == 6
    errors = [x for x in proc.stderr.splitlines() if "attached profiling is off" in x]
    assert len(errors) == 1 and "RuntimeError: injected" in errors[0], proc.stderr[-3000:]


def test_an_unreachable_coordinator_switches_profiling_off_once(tmp_path):
    store = tmp_path / "store"
    proc = run(
        textwrap.dedent(f"""
        import torch.distributed as dist
        dist.init_process_group("gloo", init_method="file://{store}", rank=0, world_size=1)
        """)
        + TRAIN,
        f"{{enable: true, save_path: {tmp_path / 'p'}}}",
    )
    assert len(losses(proc)) == 6
    errors = [x for x in proc.stderr.splitlines() if "not profiled" in x]
    assert len(errors) == 1 and "ray is not initialised" in errors[0], proc.stderr[-3000:]


def test_a_forked_child_is_never_profiled_and_says_so():
    proc = run(
        """
        import os, torch
        model = torch.nn.Linear(2, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        pid = os.fork()
        if pid == 0:
            import worker_ext.rank.attached as hook
            hook.first_step = None  # (a child that tried to attach would fail here)
            for _ in range(3):
                model(torch.ones(1, 2)).sum().backward(); opt.step()
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        print("CHILD", status)
        """,
        "{enable: true}",
    )
    assert proc.returncode == 0 and "CHILD 0" in proc.stdout, proc.stderr[-3000:]
    warnings = [x for x in proc.stderr.splitlines() if "forked from pid" in x]
    assert len(warnings) == 1, proc.stderr[-3000:]


def test_the_count_goes_on_from_an_optimizer_state_a_checkpoint_restored():
    proc = run(
        """
        import copy, json, torch
        from worker_ext.rank.attached import steps_taken
        frozen, model = torch.nn.Linear(2, 2), torch.nn.Linear(2, 1)
        frozen.requires_grad_(False)  # (no gradient, no state: looked past)
        params = [*frozen.parameters(), *model.parameters()]
        def step(opt):
            model(torch.ones(1, 2)).sum().backward(); opt.step(); opt.zero_grad()
        adam = torch.optim.AdamW(params, lr=0.1)
        for _ in range(3):
            step(adam)
        counts = [steps_taken(adam)]
        resumed = torch.optim.AdamW(params, lr=0.1)
        resumed.load_state_dict(copy.deepcopy(adam.state_dict()))  # (as from a file)
        step(resumed)
        sgd = torch.optim.SGD(params, lr=0.1, momentum=0.9)
        step(sgd)
        fresh = torch.optim.RMSprop(params, lr=0.1)
        step(fresh)
        class Odd:
            param_groups = [{"params": params}]
            state = {params[2]: {"step": "many"}}
        counts += [steps_taken(o) for o in (resumed, sgd, fresh, Odd())]
        print("LOSSES", json.dumps(counts))  # (the line that losses() reads)
        """,
        setup=False,
    )
    assert losses(proc) == [3, 4, None, 1, None]


def test_a_process_left_alone_at_its_first_step_can_still_be_driven_by_skyrl():
    # One "nothing" step for both modules: the first step's "off" is what driven_elsewhere
    # (SkyRL's profiler, built later) may replace with its own count.
    proc = run(
        """
        from worker_ext import attach
        attach.on_optimizer_step("opt", (), {})  # the first step: enable false, left alone
        assert attach._step is attach.nothing, attach._step
        counted = []
        attach.driven_elsewhere(counted.append)
        attach.on_optimizer_step("opt", (), {})
        print("COUNTED", counted)
        """,
        config="enable: false\n",
        setup=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "COUNTED ['opt']" in proc.stdout, proc.stdout


NESTED = "enable: true\nengine: kineto\nnotes: " + "[" * 5000 + "]" * 5000 + "\n"


def test_a_config_too_deep_for_the_reader_turns_only_kineto_off_and_says_so_once():
    # the reader's YAML load raises RecursionError, not ValueError: the hook still watches
    # torch.optim and registers its step hook; libkineto's variables are not set
    proc = run("""
        import os, sys
        import torch
        from torch.optim.optimizer import _global_optimizer_post_hooks as hooks
        from worker_ext.attach import on_optimizer_step
        assert list(hooks.values()) == [on_optimizer_step], hooks
        print("KINETO", sorted(k for k in os.environ if k.startswith("KINETO")))
    """, NESTED)  # fmt: skip
    assert proc.returncode == 0 and "KINETO []" in proc.stdout, proc.stderr[-3000:]
    said = [x for x in proc.stderr.splitlines() if "profiler:" in x]
    assert len(said) == 1 and "engine kineto is off in this process" in said[0], said
    assert "RecursionError" in said[0], said


def test_a_process_given_kineto_env_s_variables_has_its_directory_made_by_the_attach_hook():
    # (kineto_env() leaves Ray's hook variable out when the job's hook is this one: it must
    # then make the directory, whatever its config says)
    d = tempfile.mkdtemp(prefix="kt-", dir="/tmp")
    kdir = os.path.join(d, "k")
    try:
        proc = run(
            f"""
            import os
            print("MADE", oct(os.stat({kdir!r}).st_mode & 0o777),
                  os.path.exists(os.path.join({kdir!r}, "client.conf")))
            """,
            "enable: false\n",
            env={"KINETO_USE_DAEMON": "1", "KINETO_IPC_SOCKET_DIR": kdir},
        )
        assert "MADE 0o700 True" in proc.stdout, proc.stderr[-3000:]
    finally:
        shutil.rmtree(d, ignore_errors=True)
