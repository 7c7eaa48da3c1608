"""`wan-enhanced golden --sequence-parallel N`: the DiT golden files with the model split over
N gloo processes pass at the single-process accuracy (2 and 3 processes: the files' 2 heads
divide by 2 (Ulysses) and not by 3 (ring); their 45- and 30-row cases do not divide by 2 or
by 4 and 3 respectively), and a tampered file still fails."""

import pytest
from safetensors import safe_open
from safetensors.torch import save_file

from wan_enhanced.conformance.golden_file import GoldenFileError
from wan_enhanced.distributed.golden import check_file_split
from wan_enhanced.runner.cli import main

FILES = ["dit_wan21", "dit_wan22_ti2v"]


@pytest.mark.parametrize("world,used", [(2, "ulysses"), (3, "ring")])
@pytest.mark.parametrize("name", FILES)
def test_split_files_pass_at_single_process_accuracy(golden_dir, gloo_group, world, used, name):
    report, mode = check_file_split(golden_dir / f"{name}.safetensors", gloo_group(world))
    assert mode == used
    assert report.passed and len(report.scores) == (2 if name == "dit_wan21" else 3)
    assert max(s.max_rel for s in report.scores) < 2e-6  # as the single-process forward


@pytest.mark.parametrize("name", FILES)
def test_split_and_sharded_files_pass_at_single_process_accuracy(golden_dir, gloo_group, name):
    """The blocks sharded over the processes too (fsdp): each block gathered into the ring just
    before it computes gives the same forwards."""
    report, mode = check_file_split(golden_dir / f"{name}.safetensors", gloo_group(3), fsdp=True)
    assert mode == "ring"
    assert report.passed and len(report.scores) == (2 if name == "dit_wan21" else 3)
    assert max(s.max_rel for s in report.scores) < 2e-6


def test_uneven_lengths_are_in_the_files(golden_dir):
    """The claim in this module's docstring: the cases' token counts."""
    from wan_enhanced.conformance.golden_file import read_golden
    rows = [c.meta["seq_len"] for n in FILES
            for c in read_golden(golden_dir / f"{n}.safetensors").cases()]
    assert rows == [48, 30, 48, 45] and 45 % 2 and 30 % 4


def test_tampered_file_fails_split(golden_dir, gloo_group, tmp_path):
    bad = tmp_path / "dit_wan21.safetensors"
    with safe_open(str(golden_dir / "dit_wan21.safetensors"), "pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    tensors["output2.y"] = tensors["output2.y"] * 1.001
    save_file(tensors, str(bad), metadata=meta)
    report, _ = check_file_split(bad, gloo_group(2))
    assert [s.passed for s in report.scores] == [True, False]


def test_other_kinds_are_refused_by_the_split_check(golden_dir, gloo_group):
    with pytest.raises(GoldenFileError, match="not a DiT"):
        check_file_split(golden_dir / "vae21.safetensors", gloo_group(2))


def test_command(golden_dir, capsys):
    files = [str(golden_dir / f"{n}.safetensors") for n in FILES] + \
        [str(golden_dir / "scheduler_unipc.safetensors")]
    assert main(["golden", "--sequence-parallel", "3", *files]) == 0
    out = capsys.readouterr().out
    assert out.count("split over 3 processes, ring attention") == 2
    assert "in this process: only DiT files run split" in out
    assert "3/3 files passed" in out and "FAIL" not in out


def test_command_with_fsdp(golden_dir, capsys):
    files = [str(golden_dir / f"{n}.safetensors") for n in FILES]
    assert main(["golden", "--sequence-parallel", "2", "--fsdp", *files]) == 0
    out = capsys.readouterr().out
    assert out.count("split over 2 processes, ulysses attention, blocks sharded") == 2
    assert "2/2 files passed" in out
    assert main(["golden", "--fsdp", *files]) == 2
    assert "--fsdp shards the blocks over the processes of --sequence-parallel N" in \
        capsys.readouterr().out


@pytest.mark.parametrize("value", ["0", "x", "65"])
def test_bad_process_counts(value, capsys):
    with pytest.raises(SystemExit) as caught:
        main(["golden", "--sequence-parallel", value, "f.safetensors"])
    assert caught.value.code == 2
    assert "--sequence-parallel" in capsys.readouterr().err


def test_a_stop_signal_ends_the_command_and_its_processes(golden_dir, capsys, monkeypatch,
                                                          stray_sigterm):
    """`kill` (SIGTERM) while the second of three files runs split: the first file's scores are
    printed, the third is not checked, the worker group is shut down and the command exits 1,
    saying how far it got."""
    import os
    import signal
    import time

    from wan_enhanced.runner import golden_command

    real_start, real_split = golden_command._start_group, golden_command._split
    started, calls = [], []

    def start(world):
        group = real_start(world)
        started.append((group, group.context.processes))
        return group

    def split(path, group, fsdp):
        calls.append(path)
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the handler raises KeyboardInterrupt at once
            raise AssertionError("the signal did not stop the command")
        return real_split(path, group, fsdp)

    monkeypatch.setattr(golden_command, "_start_group", start)
    monkeypatch.setattr(golden_command, "_split", split)
    files = [str(golden_dir / f"{n}.safetensors") for n in FILES + ["dit_wan21"]]
    assert main(["golden", "--sequence-parallel", "2", *files]) == 1
    out = capsys.readouterr().out
    assert len(calls) == 2 and stray_sigterm == []
    assert out.count("split over 2 processes") == 1
    assert "interrupted: 1 of 3 files checked, 1 passed" in out
    assert "files passed" not in out
    (group, processes), = started
    assert not group.alive and len(processes) == 2
    assert all(not process.is_alive() for process in processes)
