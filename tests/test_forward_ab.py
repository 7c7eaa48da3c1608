"""bench/run_forward_ab.sh: variants overlaid on the checkout in turns, one run each, and the
checkout's own files back after every run, also after a failing one."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "run_forward_ab.sh"


@pytest.fixture
def checkout(tmp_path):
    (tmp_path / "wan").mkdir()
    (tmp_path / "wan" / "kernel.py").write_text("base\n")
    new = tmp_path / "variants" / "new"
    (new / "wan").mkdir(parents=True)
    (new / "wan" / "kernel.py").write_text("new\n")
    (new / "wan" / "extra.py").write_text("extra\n")
    return tmp_path


def run(checkout, *args):
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=checkout, capture_output=True,
                          text=True, timeout=60)


def test_variants_alternate_and_the_checkout_comes_back(checkout):
    done = run(checkout, "2", "base", "variants/new", "--", "sh", "-c",
               'echo "$AB_ROUND $AB_VARIANT $(cat wan/kernel.py) $(ls wan | tr "\\n" " ")"')
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "== 1 base", "1 base base kernel.py ",
        "== 1 variants/new", "1 variants/new new extra.py kernel.py ",
        "== 2 base", "2 base base kernel.py ",
        "== 2 variants/new", "2 variants/new new extra.py kernel.py "]
    assert (checkout / "wan" / "kernel.py").read_text() == "base\n"
    assert not (checkout / "wan" / "extra.py").exists()


def test_a_failing_run_is_reported_and_still_restores(checkout):
    done = run(checkout, "1", "variants/new", "--", "sh", "-c", "cat wan/kernel.py; exit 3")
    assert done.returncode == 1 and done.stdout.splitlines() == ["== 1 variants/new", "new"]
    assert (checkout / "wan" / "kernel.py").read_text() == "base\n"
    assert not (checkout / "wan" / "extra.py").exists()


def test_bad_arguments_are_refused_before_anything_runs(checkout):
    missing = run(checkout, "1", "variants/none", "--", "true")
    assert missing.returncode == 2 and "no variant folder variants/none" in missing.stderr
    no_command = run(checkout, "1", "base", "--")
    assert no_command.returncode == 2 and "usage" in no_command.stderr


def test_a_stopped_comparison_restores_the_checkout(checkout):
    """`kill` of the comparison (its process group, as a terminal's Ctrl-C or a job control
    stop reaches it) mid-run: the overlaid files go back."""
    import os
    import signal
    import time

    # the command says when it runs (a signal that came while bash was still starting it could
    # be taken by bash's own trap in the child and leave the sleep running)
    command = "echo running > running; exec sleep 30"
    proc = subprocess.Popen(["bash", str(SCRIPT), "1", "variants/new", "--", "sh", "-c", command],
                            cwd=checkout, stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    assert proc.stdout.readline() == "== 1 variants/new\n"
    deadline = time.time() + 10
    while not (checkout / "running").exists() and time.time() < deadline:
        time.sleep(0.01)
    assert (checkout / "wan" / "kernel.py").read_text() == "new\n"
    os.killpg(proc.pid, signal.SIGTERM)
    assert proc.wait(timeout=20) != 0
    assert (checkout / "wan" / "kernel.py").read_text() == "base\n"
    assert not (checkout / "wan" / "extra.py").exists()
