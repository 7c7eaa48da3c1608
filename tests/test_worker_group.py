"""The warm worker group on gloo processes: results, failures named by rank, interrupts that
stop every rank at the same step, and nothing left running after a shutdown."""

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from wan_enhanced.distributed.contracts import Float32Settings
from wan_enhanced.distributed.errors import WorkerFailed
from wan_enhanced.distributed.group import WorkerGroup

TIMEOUT = 60
REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def fresh_group():
    groups = []

    def start(world=2):
        group = WorkerGroup(world, "cpu", start_timeout_s=TIMEOUT).start()
        groups.append(group)
        return group

    yield start
    for group in groups:
        group.shutdown()


def _gone(group_processes):
    return all(not p.is_alive() for p in group_processes)


def test_runs_on_every_rank_and_keeps_its_cache(gloo_group):
    group = gloo_group(3)
    assert group.run("dist_tasks:rank_sum", {"a": 1}, timeout_s=TIMEOUT)["sum"] == 6.0
    first = group.run("dist_tasks:count_calls", None, timeout_s=TIMEOUT)
    assert group.run("dist_tasks:count_calls", None, timeout_s=TIMEOUT) == first + 1
    assert [info["device"] for info in group.info] == ["cpu"] * 3


def test_every_task_runs_with_the_drivers_float32_settings(gloo_group):
    """TF32 is process state: the ranks take the driver's settings at every task (a rank with
    torch's defaults would round convolutions to TF32 where the driver does not)."""
    group = gloo_group(3)
    before = Float32Settings.current()
    try:
        for wanted in (Float32Settings("highest", False, False),
                       Float32Settings("high", True, False),
                       Float32Settings("highest", False, True)):
            wanted.apply()
            assert Float32Settings.current() == wanted
            seen = group.run("dist_tasks:float32_settings", None, timeout_s=TIMEOUT)
            assert Float32Settings(*seen) == wanted
    finally:
        before.apply()


def test_a_failing_rank_is_named_and_the_group_ends(fresh_group):
    group = fresh_group(3)
    processes = list(group.context.processes)
    with pytest.raises(WorkerFailed) as caught:
        group.run("dist_tasks:fail_on", 2, timeout_s=TIMEOUT)
    error = caught.value
    assert error.rank == 2 and error.device == "CPU process 2"
    assert str(error).startswith("rank 2 (CPU process 2) failed: ValueError: this rank was told "
                                 "to fail. The worker group was shut down")
    assert "Traceback" in error.details and "fail_on" in error.details
    assert not group.alive and _gone(processes)
    with pytest.raises(WorkerFailed, match="not running"):
        group.run("dist_tasks:rank_sum", None)


def test_a_dead_rank_is_named(fresh_group):
    group = fresh_group(2)
    with pytest.raises(WorkerFailed, match=r"rank 1 \(CPU process 1\) failed: its process "
                                           r"exited with code 3"):
        group.run("dist_tasks:exit_on", 1, timeout_s=TIMEOUT)
    assert not group.alive


def test_a_rank_killed_between_runs_is_found(fresh_group):
    group = fresh_group(2)
    group.context.processes[0].kill()
    group.context.processes[0].join(5)
    with pytest.raises(WorkerFailed, match="not running"):
        group.run("dist_tasks:rank_sum", None, timeout_s=TIMEOUT)


class _InterruptAfter:
    """An interrupt check that raises once `steps` progress messages have arrived."""

    def __init__(self, steps):
        self.steps, self.seen = steps, []

    def progress(self, data):
        self.seen.append(data["step"])

    def __call__(self):
        if len(self.seen) >= self.steps:
            raise KeyboardInterrupt("stop")


def test_interrupt_stops_every_rank_at_one_step_and_the_group_stays(gloo_group):
    group = gloo_group(3)
    check = _InterruptAfter(2)
    began = time.monotonic()
    with pytest.raises(KeyboardInterrupt, match="stop"):
        group.run("dist_tasks:steps", (200, 0.05), on_progress=check.progress, interrupt=check,
                  timeout_s=TIMEOUT)
    assert time.monotonic() - began < 5  # not the 10 s of 200 steps
    assert 2 <= len(check.seen) <= 4
    assert group.alive
    assert group.run("dist_tasks:steps", (3, 0.0), timeout_s=TIMEOUT) == 3


def test_ranks_that_do_not_stop_are_shut_down(fresh_group):
    group = fresh_group(2)
    processes = list(group.context.processes)

    def interrupt():
        raise KeyboardInterrupt("stop")

    with pytest.raises(KeyboardInterrupt):
        group.run("dist_tasks:ignore_stop", 30, interrupt=interrupt, stop_grace_s=0.5,
                  timeout_s=TIMEOUT)
    assert not group.alive and _gone(processes)


def test_no_answer_in_time(fresh_group):
    group = fresh_group(2)
    with pytest.raises(WorkerFailed, match="no answer within 1 s"):
        group.run("dist_tasks:ignore_stop", 30, timeout_s=1)
    assert not group.alive


def test_started_from_a_script_and_a_package_imported_by_path(tmp_path):
    """As inside ComfyUI: the package registered under its folder's path (not importable by name
    in a fresh interpreter) and a main script that must not run again in the ranks."""
    script = tmp_path / "main.py"
    script.write_text(textwrap.dedent(f"""
        import importlib.util, sys
        if __name__ != "__main__":
            raise SystemExit("the host's main script ran again in a worker")
        # ComfyUI's load_custom_node names the package by its path, dots as "_x_"
        name = {str(REPO / "custom_nodes" / "comfyui-wan-enhanced").replace(".", "_x_")!r}
        spec = importlib.util.spec_from_file_location(
            name, {str(REPO / "__init__.py")!r}, submodule_search_locations=[{str(REPO)!r}])
        package = importlib.util.module_from_spec(spec)
        sys.modules[name] = package
        spec.loader.exec_module(package)
        group_module = sys.modules[name + ".distributed.group"] if name + ".distributed.group" \\
            in sys.modules else __import__(name + ".distributed.group", fromlist=["_"])
        group = group_module.WorkerGroup(2, "cpu", start_timeout_s=60).start()
        print("ranks", [info["device"] for info in group.info])
        group.shutdown()
    """))
    env = {k: v for k, v in __import__("os").environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=120, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "ranks ['cpu', 'cpu']" in done.stdout


def test_progress_is_sent_once_the_gpu_has_done_the_step(monkeypatch):
    """A step's progress leaves rank 0 only after its device synchronized (the step computed,
    not merely queued); other ranks send nothing, and a CPU rank has nothing to wait for."""
    import multiprocessing

    import torch

    from wan_enhanced.distributed import worker
    from wan_enhanced.distributed.messages import receive

    order = []
    monkeypatch.setattr(torch.cuda, "synchronize",
                        lambda device=None: order.append(("sync", device)))
    ours, drivers = multiprocessing.Pipe()
    try:
        cuda = torch.device("cuda", 1)
        worker.WorkerState(0, 2, cuda, ours, None).progress({"step": 3, "total": 5})
        order.append(receive(drivers, ()))
        worker.WorkerState(1, 2, cuda, ours, None).progress({"step": 3, "total": 5})
        worker.WorkerState(0, 1, torch.device("cpu"), ours, None).progress({"step": 4, "total": 5})
        order.append(receive(drivers, ()))
        assert not drivers.poll(0.1)
    finally:
        ours.close()
        drivers.close()
    assert order == [("sync", cuda), ("progress", {"step": 3, "total": 5}),
                     ("progress", {"step": 4, "total": 5})]
