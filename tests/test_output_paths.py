"""Every file a workflow makes the package write stays inside its output folder: the memory
probe's event log, its report, a video's filename prefix, files downloaded from a server. Names
that are absolute, step out with '..' or pass through a symbolic link leading out are refused,
and the file they named is left untouched."""

from __future__ import annotations

import json
import os

import pytest

from wan_enhanced import host
from wan_enhanced.nodes.common import NodeInputError
from wan_enhanced.nodes.memory import WanMemoryProbe
from wan_enhanced.pipeline.video_io import next_output_path
from wan_enhanced.runner import cli
from wan_enhanced.runner.client import ServerError, download_path
from wan_enhanced.safe_paths import UnsafePathError, name_problem, path_inside

VICTIM_TEXT = "precious data\n"


@pytest.fixture
def out(tmp_path):
    folder = tmp_path / "out"
    folder.mkdir()
    host.set_headless_folders(output=folder)
    yield folder
    host.set_headless_folders(models="models", output="output")


@pytest.fixture
def victim(tmp_path):
    path = tmp_path / "victim.txt"
    path.write_text(VICTIM_TEXT)
    return path


def probe_workflow(save_log: str) -> dict:
    return {"1": {"class_type": "WanEnhancedMemoryProbe",
                  "inputs": {"value": 1, "label": "x", "save_log": save_log}}}


def run_cli(tmp_path, workflow: dict, out) -> int:
    path = tmp_path / "workflow.json"
    path.write_text(json.dumps(workflow))
    return cli.main(["run", str(path), "--out", str(out), "--quiet"])


@pytest.mark.parametrize("save_log", ["../victim.txt", "../victim.json", "sub/../../victim.json",
                                      "..\\victim.json"])
def test_probe_save_log_cannot_step_out_of_the_output_folder(tmp_path, out, victim, save_log,
                                                             capsys):
    assert run_cli(tmp_path, probe_workflow(save_log), out) == 2
    assert victim.read_text() == VICTIM_TEXT
    assert not (tmp_path / "victim.json").exists()
    message = capsys.readouterr().err
    assert "WanEnhancedMemoryProbe" in message and "save_log" in message
    assert "outside the output folder" in message or ".json" in message


def test_probe_save_log_cannot_be_an_absolute_path(tmp_path, out, victim, capsys):
    target = tmp_path / "victim.json"
    target.write_text(VICTIM_TEXT)
    assert run_cli(tmp_path, probe_workflow(str(target)), out) == 2
    assert target.read_text() == VICTIM_TEXT
    assert "absolute path" in capsys.readouterr().err


def test_probe_save_log_cannot_pass_through_a_link_leading_out(tmp_path, out, capsys):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (out / "link").symlink_to(elsewhere, target_is_directory=True)
    assert run_cli(tmp_path, probe_workflow("link/log.json"), out) == 2
    assert os.listdir(elsewhere) == []
    assert "symbolic link" in capsys.readouterr().err


def test_probe_refuses_at_run_time_too(tmp_path, out, victim):
    """A node called directly (or with save_log linked from another node, which validation
    cannot see) still refuses before writing."""
    probe = WanMemoryProbe()
    for bad in ("../victim.txt", str(victim), "../victim.json"):
        with pytest.raises(NodeInputError, match="Wan Memory Probe: save_log"):
            probe.probe(1, "x", save_log=bad)
    assert victim.read_text() == VICTIM_TEXT
    assert set(tmp_path.iterdir()) == {victim, out} and os.listdir(out) == []


def test_probe_writes_inside_the_output_folder(out):
    result = WanMemoryProbe().probe(1, "x", save_log="runs/log.json")
    assert result["ui"]["memory_log"] == [str(out / "runs" / "log.json")]
    assert json.loads((out / "runs" / "log.json").read_text())["schema"].startswith(
        "wan-enhanced-memory-events")
    assert WanMemoryProbe.VALIDATE_INPUTS(save_log="runs/log.json") is True
    assert "json" in WanMemoryProbe.VALIDATE_INPUTS(save_log="runs/log.txt")


def test_filename_prefix_absolute_is_refused_not_reinterpreted(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(UnsafePathError, match="filename_prefix: .*absolute"):
        next_output_path(out, str(tmp_path / "elsewhere" / "clip"))
    with pytest.raises(UnsafePathError, match="filename_prefix"):
        next_output_path(out, "C:\\videos\\clip")
    assert not (out / "tmp").exists() and not out.exists()


def test_filename_prefix_through_a_link_leading_out_is_refused(tmp_path):
    out, elsewhere = tmp_path / "out", tmp_path / "elsewhere"
    out.mkdir()
    elsewhere.mkdir()
    (out / "wan").symlink_to(elsewhere, target_is_directory=True)
    with pytest.raises(UnsafePathError, match="symbolic link"):
        next_output_path(out, "wan/clip")
    assert next_output_path(out, "inside/clip") == out / "inside" / "clip_00001.mp4"


@pytest.mark.parametrize("entry", [
    {"filename": "x.mp4", "subfolder": "../..", "type": "output"},
    {"filename": "..", "subfolder": "", "type": "output"},
    {"filename": "x.mp4", "subfolder": "", "type": "../../etc"},
    {"filename": "x.mp4", "subfolder": "/etc", "type": "output"},
    {"filename": "/etc/passwd", "subfolder": "", "type": "output"},
    {"filename": "", "subfolder": "", "type": "output"},
])
def test_downloads_from_a_server_stay_in_the_download_folder(tmp_path, entry):
    with pytest.raises(ServerError, match="download folder"):
        download_path(entry, tmp_path / "downloads")
    assert not (tmp_path / "downloads").exists()


def test_download_paths_keep_their_subfolders(tmp_path):
    assert download_path({"filename": "c.mp4", "subfolder": "wan/a", "type": "output"},
                         tmp_path) == tmp_path / "wan" / "a" / "c.mp4"
    assert download_path({"filename": "p.png", "subfolder": "", "type": "temp"},
                         tmp_path) == tmp_path / "temp" / "p.png"


@pytest.mark.parametrize("name, problem", [
    ("clip", None), ("wan/clip", None), ("a\\b", None), ("./a", None),
    ("", "empty"), ("  ", "empty"), ("a\x00b", "NUL"), ("/etc/x", "absolute"),
    ("\\\\server\\share\\x", "absolute"), ("C:x", "absolute"), ("D:\\x", "absolute"),
    ("..", "'..'"), ("a/../../b", "'..'"), ("a\\..\\..\\b", "'..'"), (3, "text"),
])
def test_name_problems(name, problem):
    found = name_problem(name)
    assert (found is None) if problem is None else (problem in found)


def test_path_inside_resolves_links(tmp_path):
    root = tmp_path / "root"
    (root / "real").mkdir(parents=True)
    (root / "inner").symlink_to(root / "real", target_is_directory=True)
    assert path_inside(root, "inner/x.json", "f") == root / "inner" / "x.json"
    (root / "file").symlink_to(tmp_path / "outside.json")
    with pytest.raises(UnsafePathError, match="f: 'file' leads outside"):
        path_inside(root, "file", "f")
    with pytest.raises(UnsafePathError, match="empty"):
        path_inside(root, ".", "f")


def test_prefixes_that_cannot_be_written_are_refused_at_validation(tmp_path):
    """A prefix ending in a folder, or a last part the file system cannot hold with the
    temporary name written beside the video (ASCII or CJK, in UTF-8 bytes), is refused before
    anything runs; the longest accepted one is written."""
    import torch

    from wan_enhanced import host
    from wan_enhanced.nodes.video import WanSaveVideo
    from wan_enhanced.pipeline.video_io import video_name_problem

    assert "ends in a folder" in video_name_problem(tmp_path, "wan/")
    limit = os.pathconf(tmp_path, "PC_NAME_MAX")
    room = next(n for n in range(limit, 0, -1) if video_name_problem(tmp_path, "a" * n) is None)
    assert f"more than the {room} bytes left" in video_name_problem(tmp_path, "a" * (room + 1))
    cjk = "猫" * (room // 3 + 1)  # 3 bytes each in UTF-8
    assert "bytes in UTF-8" in video_name_problem(tmp_path, cjk)
    host.set_headless_folders(output=tmp_path)
    try:
        assert WanSaveVideo.VALIDATE_INPUTS("b" * (room + 1), 16.0) is not True
        assert WanSaveVideo.VALIDATE_INPUTS("b" * room, 16.0) is True
        WanSaveVideo().save(torch.zeros(2, 16, 16, 3), "b" * room, 8.0, 23)
        assert [p.name for p in tmp_path.iterdir()] == ["b" * room + "_00001.mp4"]
    finally:
        host.set_headless_folders(output="output")
