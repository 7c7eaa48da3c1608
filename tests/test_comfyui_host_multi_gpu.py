"""The several-GPU path inside a real ComfyUI (started with WAN_ENHANCED_DEVICE=cpu, so `gpus`
counts gloo CPU processes): ComfyUI's process spawns and drives the ranks although it
registers this package under its folder's path and its main script must not run again in them;
the video equals the one-process video; ComfyUI's interrupt stops every rank and the warm ranks
serve the next prompt.

Needs a host made by tools/comfyui_host.sh (COMFYUI_HOME); skipped without one.
"""

import os
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from test_comfyui_host import COMFY, PACK, PYTHON, _free_port

from wan_enhanced.checkpoints.tiny import write_models_folder
from wan_enhanced.pipeline.video_io import read_mp4
from wan_enhanced.runner.client import Client, RemoteInterrupted
from wan_enhanced.runner.demo_command import DEMO_SETTINGS, WORKFLOW
from wan_enhanced.runner.overrides import apply_overrides
from wan_enhanced.runner.workflow import load_workflow

pytestmark = pytest.mark.skipif(not (COMFY / "main.py").is_file() or not PYTHON.is_file(),
                                reason="no ComfyUI host (set COMFYUI_HOME; see "
                                       "tools/comfyui_host.sh)")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("comfy_multi")
    models = write_models_folder(root / "models", dit_name="wan2.2_ti2v_5B_fp16.safetensors",
                                 vae_name="wan2.2_vae.safetensors",
                                 text_encoder_name="umt5_xxl_fp16.safetensors", kind="ti2v")
    config = root / "extra_models.yaml"
    config.write_text(f"wan_test:\n  base_path: {models}\n  diffusion_models: diffusion_models\n"
                      f"  text_encoders: text_encoders\n  vae: vae\n")
    link = COMFY / "custom_nodes" / PACK.name
    if not link.exists():
        link.symlink_to(PACK)
    port = _free_port()
    log = open(root / "server.log", "w")
    env = {**os.environ, "WAN_ENHANCED_DEVICE": "cpu"}
    env.pop("PYTHONPATH", None)
    process = subprocess.Popen(
        [str(PYTHON), "main.py", "--cpu", "--listen", "127.0.0.1", "--port", str(port),
         "--extra-model-paths-config", str(config), "--output-directory", str(root / "out"),
         "--disable-all-custom-nodes", "--whitelist-custom-nodes", PACK.name],
        cwd=COMFY, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 180
    while time.time() < deadline and process.poll() is None:
        try:
            urllib.request.urlopen(url + "/system_stats", timeout=2)
            break
        except OSError:
            time.sleep(1)
    if process.poll() is not None or time.time() >= deadline:
        process.kill()
        pytest.fail("ComfyUI did not start:\n" + (root / "server.log").read_text()[-3000:])
    yield url, root
    process.terminate()
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
    log.close()


def _workflow(client, *settings):
    return apply_overrides(load_workflow(WORKFLOW), [*DEMO_SETTINGS, "5.width=160",
                                                     "5.height=96", "5.frames=9", *settings],
                           client.registry())


def _video(result) -> Path:
    (video,) = [Path(f) for f in result.files if str(f).endswith(".mp4")]
    return video


def test_gpus_2_inside_comfyui_gives_the_one_process_video(server, tmp_path):
    url, root = server
    client = Client(url, timeout=120)
    one = client.run(_workflow(client, "8.filename_prefix=one"), tmp_path / "a")
    two = client.run(_workflow(client, "8.filename_prefix=two", "6.gpus=2"), tmp_path / "b")
    assert one.status == two.status == "success"
    frames_one, _ = read_mp4(_video(one))
    frames_two, _ = read_mp4(_video(two))
    assert frames_one.shape == frames_two.shape and (frames_one == frames_two).all()
    log = (root / "server.log").read_text()
    assert "WorkerFailed" not in log and "NodeRunError" not in log, log[-3000:]


def test_comfyui_interrupt_stops_every_rank_and_the_next_prompt_runs(server, tmp_path):
    url, root = server
    client = Client(url, timeout=120)
    client.run(_workflow(client, "6.gpus=2", "6.steps=1"), tmp_path / "warm")
    timer = threading.Timer(4.0, client.interrupt)
    timer.start()
    began = time.monotonic()
    with pytest.raises(RemoteInterrupted):
        client.run(_workflow(client, "6.gpus=2", "6.steps=500"), tmp_path / "long")
    timer.join()
    assert time.monotonic() - began < 60
    result = client.run(_workflow(client, "6.gpus=2", "6.steps=2", "8.filename_prefix=after"),
                        tmp_path / "after")
    assert result.status == "success"
    log = (root / "server.log").read_text()
    assert log.count("wan-enhanced: started 2 worker process(es)") == 1  # the same warm ranks
