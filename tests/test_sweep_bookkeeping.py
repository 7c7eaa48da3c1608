"""Sweep bookkeeping that survives reruns and kills: jobs are keyed on the output folder too, a
video written just before a kill is recorded instead of written twice, and the hidden temporary
files of killed writers are cleaned up."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch

from wan_enhanced import host
from wan_enhanced.atomic_files import remove_stale_partials, write_atomically
from wan_enhanced.runner import cli
from wan_enhanced.runner.sweep import ResultsLog

WORKFLOW = Path(__file__).resolve().parent.parent / "api_workflows" / \
    "wan22_ti2v_5b_speed_preview.json"
from tiny_sets import DIT, TE, VAE


@pytest.fixture(scope="module")
def models(ti2v_models):
    return ti2v_models


def decode_and_save_in_one(workflow: dict) -> dict:
    """The workflow with its Wan Tiled Decode and Wan Save Video as one Wan Decode and Save
    Video node (the decode's id)."""
    (decode,) = [k for k, v in workflow.items() if v["class_type"] == "WanEnhancedTiledDecode"]
    (save,) = [k for k, v in workflow.items() if v["class_type"] == "WanEnhancedSaveVideo"]
    inputs = {k: v for k, v in workflow.pop(save)["inputs"].items() if k != "images"}
    workflow[decode] = {"class_type": "WanEnhancedDecodeSaveVideo",
                        "inputs": {**workflow[decode]["inputs"], **inputs}}
    return workflow


@pytest.fixture(params=["two nodes", "one node"])
def sweep(request, tmp_path, models):
    workflow = json.loads(WORKFLOW.read_text())
    if request.param == "one node":
        workflow = decode_and_save_in_one(workflow)
    workflow["1"]["inputs"].update(model_name=DIT, weight_dtype="fp32")
    workflow["2"]["inputs"].update(text_encoder_name=TE, dtype="fp32", device="cpu")
    workflow["3"]["inputs"].update(vae_name=VAE, dtype="fp32")
    workflow["5"]["inputs"].update(width=64, height=64, frames=5)
    workflow["6"]["inputs"].update(steps=1)
    path = tmp_path / "workflow.json"
    path.write_text(json.dumps(workflow))
    values = tmp_path / "sweep.json"
    values.write_text(json.dumps({"seed": [1, 2]}))
    yield path, values, models
    host.set_headless_folders(models="models", output="output")


def run_sweep(sweep, out, results) -> int:
    workflow, values, models = sweep
    return cli.main(["run", str(workflow), "--sweep", str(values), "--models", str(models),
                     "--out", str(out), "--results", str(results), "--quiet"])


def videos(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.rglob("*.mp4"))


def test_a_new_output_folder_runs_the_sweep_again(sweep, tmp_path):
    results = tmp_path / "results.jsonl"
    assert run_sweep(sweep, tmp_path / "a", results) == 0
    assert len(videos(tmp_path / "a")) == 2
    assert run_sweep(sweep, tmp_path / "b", results) == 0
    assert len(videos(tmp_path / "b")) == 2  # it used to write nothing and exit 0
    assert run_sweep(sweep, tmp_path / "a", results) == 0
    assert len(videos(tmp_path / "a")) == 2  # the same folder: skipped
    success = [r for r in ResultsLog(results).records if r["status"] == "success"]
    assert len(success) == 4 and len({r["job_key"] for r in success}) == 4


class Killed(BaseException):
    """What the process sees of kill -9: nothing after this point runs."""


def test_video_written_before_a_kill_is_recorded_not_written_again(sweep, tmp_path,
                                                                   monkeypatch):
    results, out = tmp_path / "results.jsonl", tmp_path / "out"
    real_append = ResultsLog.append

    def append(log, record):
        if record["status"] == "success":
            raise Killed  # killed after the video, before its line
        real_append(log, record)

    monkeypatch.setattr(ResultsLog, "append", append)
    with pytest.raises(Killed):
        run_sweep(sweep, out, results)
    monkeypatch.undo()
    assert videos(out) == ["ti2v_speed_preview_00001.mp4"]
    assert [r["status"] for r in ResultsLog(results).records] == ["writing"]

    assert run_sweep(sweep, out, results) == 0
    assert videos(out) == ["ti2v_speed_preview_00001.mp4", "ti2v_speed_preview_00002.mp4"]
    records = [r for r in ResultsLog(results).records if r["status"] == "success"]
    assert len(records) == 2 and records[0].get("recovered") is True
    assert records[0]["outputs"] == [str(out / "wan" / "ti2v_speed_preview_00001.mp4")]
    assert records[0]["settings"] == {"seed": 1} and records[1]["settings"] == {"seed": 2}


KILLED_WHILE_ENCODING = """
import os, sys
from wan_enhanced.nodes import video
from wan_enhanced.pipeline import decode_video
from wan_enhanced.runner import cli
# kill -9 in the middle of the encode (after the decode, or while it goes on)
video.save_mp4 = decode_video.save_mp4 = lambda *args, **kwargs: os._exit(9)
sys.exit(cli.main(sys.argv[1:]))
"""


def run_killed_while_encoding(sweep, tmp_path, out, results) -> None:
    """The sweep in a process killed (kill -9) in its first job's video encode."""
    import subprocess
    import sys

    workflow, values, models = sweep
    script = tmp_path / "killed.py"
    script.write_text(KILLED_WHILE_ENCODING)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, str(script), "run", str(workflow), "--sweep",
                           str(values), "--models", str(models), "--out", str(out),
                           "--results", str(results), "--quiet"], env=env, capture_output=True)
    assert done.returncode == 9, done.stderr


def test_a_video_that_was_not_finished_is_made_again(sweep, tmp_path):
    results, out = tmp_path / "results.jsonl", tmp_path / "out"
    run_killed_while_encoding(sweep, tmp_path, out, results)
    assert videos(out) == [] and [r["status"] for r in ResultsLog(results).records] == ["writing"]
    assert run_sweep(sweep, out, results) == 0
    assert len(videos(out)) == 2
    assert not any(r.get("recovered") for r in ResultsLog(results).records)


def _dead_pid() -> int:
    pid = 4_000_000
    while True:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return pid
        except PermissionError:
            pass
        pid += 1


def test_stale_partials_are_removed_and_their_numbers_freed(sweep, tmp_path):
    out = tmp_path / "out"
    (out / "wan").mkdir(parents=True)
    dead = out / "wan" / f".ti2v_speed_preview_00007.mp4.{_dead_pid()}-0123abcd.partial"
    legacy = out / "wan" / ".ti2v_speed_preview_00005.mp4.89abcdef.partial"
    live = out / "wan" / f".ti2v_speed_preview_00003.mp4.{os.getpid()}-fedcba98.partial"
    for path in (dead, legacy, live):
        path.write_bytes(b"half a video")
    old = time.time() - 2 * 3600
    os.utime(legacy, (old, old))
    assert run_sweep(sweep, out, tmp_path / "results.jsonl") == 0
    assert not dead.exists() and not legacy.exists()
    assert live.exists()  # a writer that still runs keeps its file
    assert videos(out) == ["ti2v_speed_preview_00004.mp4", "ti2v_speed_preview_00005.mp4"]


def test_atomic_writes_clean_their_folder_and_keep_normal_permissions(tmp_path):
    stale = tmp_path / f".log.json.{_dead_pid()}-00112233.partial"
    young = tmp_path / ".log.json.44556677.partial"  # an older version's, not an hour old
    other = tmp_path / ".hidden.txt"
    for path in (stale, young, other):
        path.write_text("x")
    write_atomically(tmp_path / "log.json", b"{}")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [".hidden.txt", ".log.json.44556677.partial", "log.json"])
    assert remove_stale_partials(tmp_path) == []
    umask = os.umask(0)
    os.umask(umask)
    assert (tmp_path / "log.json").stat().st_mode & 0o777 == 0o666 & ~umask


# -- claimed names: concurrent writers, another run's video, a reused process id ----------------

CONCURRENT_WRITER = """
import sys, torch
from wan_enhanced.nodes.video import WanSaveVideo
from wan_enhanced import host
host.set_headless_folders(output=sys.argv[1])
seed = int(sys.argv[2])
for i in range(int(sys.argv[3])):
    frames = torch.full((2, 16, 16, 3), ((seed * 37 + i * 11) % 97) / 97.0)
    WanSaveVideo().save(frames, "wan/race", 8.0, 23)
"""


def test_processes_writing_into_one_folder_keep_every_video(tmp_path):
    """Three processes saving six videos each into one folder at once: 18 files, each a whole
    video (the numbers are claimed across processes; nothing replaces another's file)."""
    import subprocess
    import sys

    from wan_enhanced.pipeline.video_io import read_mp4

    script = tmp_path / "writer.py"
    script.write_text(CONCURRENT_WRITER)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = tmp_path / "out"
    writers = [subprocess.Popen([sys.executable, str(script), str(out), str(seed), "6"], env=env,
                                stderr=subprocess.PIPE) for seed in range(3)]
    for writer in writers:
        assert writer.wait(timeout=300) == 0, writer.stderr.read().decode()
    names = videos(out)
    assert names == [f"race_{n:05d}.mp4" for n in range(1, 19)]
    seen = {tuple(read_mp4(out / "wan" / name)[0][0, 0, 0].tolist()) for name in names}
    assert len(seen) == 18  # 18 different videos: none was written over another
    assert not [p for p in (out / "wan").iterdir() if p.name.startswith(".")]  # no claims left


def test_a_recorded_name_holding_another_runs_video_is_not_recovered(sweep, tmp_path):
    """A job killed (kill -9) while its video was encoded leaves a "writing" line and no video;
    another run into the folder then takes that number (the dead writer's claim is cleaned).
    The rerun sees the file there does not carry the job's token and runs the job again,
    instead of recording the other run's video as the job's."""
    from wan_enhanced.nodes.video import WanSaveVideo

    results, out = tmp_path / "results.jsonl", tmp_path / "out"
    run_killed_while_encoding(sweep, tmp_path, out, results)
    (line,) = ResultsLog(results).records
    assert line["status"] == "writing" and line["token"]
    recorded = Path(line["file"])
    assert not recorded.exists()
    host.set_headless_folders(output=out)  # another run writes into the folder
    WanSaveVideo().save(torch.zeros(2, 16, 16, 3), "wan/ti2v_speed_preview", 8.0, 23)
    assert recorded.exists()
    assert run_sweep(sweep, out, results) == 0
    records = [r for r in ResultsLog(results).records if r["status"] == "success"]
    assert len(records) == 2 and not any(r.get("recovered") for r in records)
    assert str(recorded) not in [f for r in records for f in r["outputs"]]
    assert len(videos(out)) == 3


def test_a_killed_writers_files_go_when_its_process_id_belongs_to_another_process(tmp_path):
    """A partial and a claim of a writer that was PID 1 in an earlier container: PID 1 runs
    again (another process, started later), and the files are still removed."""
    from wan_enhanced.atomic_files import claim, writer_tag

    me = writer_tag()
    pid, start = me.split("@")
    earlier = int(start) - 100_000  # the same id, a process that started long before
    partial = tmp_path / f".clip_00001.mp4.{pid}@{earlier}-0123abcd.partial"
    partial.write_bytes(b"half a video")
    stale_claim = tmp_path / ".clip_00002.mp4.claim"
    stale_claim.write_text(json.dumps({"writer": f"{pid}@{earlier}", "token": "ab"}))
    mine = claim(tmp_path / "clip_00003.mp4")
    own_partial = tmp_path / f".clip_00003.mp4.{me}-fedcba98.partial"
    own_partial.write_bytes(b"being written")
    removed = remove_stale_partials(tmp_path)
    assert sorted(p.name for p in removed) == sorted([partial.name, stale_claim.name])
    assert mine.claim_file.exists() and own_partial.exists()
    assert claim(tmp_path / "clip_00003.mp4") is None  # held by this process
    mine.release()
    assert claim(tmp_path / "clip_00003.mp4") is not None


def test_a_finished_video_never_replaces_a_file_it_did_not_write(tmp_path):
    from wan_enhanced.pipeline.video_io import save_mp4

    target = tmp_path / "clip.mp4"
    target.write_bytes(b"someone else's video")
    with pytest.raises(FileExistsError, match="nothing was replaced"):
        save_mp4(torch.zeros(2, 16, 16, 3), target, 8, replace=False)
    assert target.read_bytes() == b"someone else's video"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["clip.mp4"]  # no partial left


def test_a_lone_surrogate_in_a_workflow_runs_and_is_recorded(sweep, tmp_path):
    """A JSON escape of half a character ("\\ud800") in a prompt: ComfyUI runs such a workflow;
    the sweep's job key and results line used to fail on it (UnicodeEncodeError, rc 1)."""
    workflow_path, values, models = sweep
    workflow = json.loads(workflow_path.read_text())
    workflow["4"]["inputs"]["positive"] = "a fox \ud800 in the snow"
    workflow_path.write_text(json.dumps(workflow))  # written escaped, as a browser sends it
    results, out = tmp_path / "results.jsonl", tmp_path / "out"
    assert run_sweep(sweep, out, results) == 0
    records = [r for r in ResultsLog(results).records if r["status"] == "success"]
    assert len(records) == 2 and len(videos(out)) == 2
    assert run_sweep(sweep, out, results) == 0  # the keys are stable: nothing runs again
    assert len(videos(out)) == 2
