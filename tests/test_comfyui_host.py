"""The package inside a real ComfyUI: it loads without import errors, every node is listed in
/object_info with the inputs we declare, and the demo workflow runs through /prompt to an MP4.

Needs a host made by ../shared/tools/comfyui-host.sh (COMFYUI_HOME); skipped without one.
"""

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from wan_enhanced import NODE_CLASS_MAPPINGS
from wan_enhanced.checkpoints.tiny import write_models_folder
from wan_enhanced.runner.client import Client
from wan_enhanced.runner.demo_command import DEMO_SETTINGS, WORKFLOW
from wan_enhanced.runner.overrides import apply_overrides
from wan_enhanced.runner.workflow import load_workflow

HOME = Path(os.environ.get("COMFYUI_HOME", "/nonexistent"))
COMFY = HOME / "ComfyUI"
PYTHON = HOME / "venv" / "bin" / "python"
pytestmark = pytest.mark.skipif(not (COMFY / "main.py").is_file() or not PYTHON.is_file(),
                                reason="no ComfyUI host (set COMFYUI_HOME; see "
                                       "../shared/tools/comfyui-host.sh)")
PACK = Path(__file__).resolve().parent.parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("comfy")
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
    process = subprocess.Popen(
        [str(PYTHON), "main.py", "--cpu", "--listen", "127.0.0.1", "--port", str(port),
         "--extra-model-paths-config", str(config), "--output-directory", str(root / "out"),
         "--disable-all-custom-nodes", "--whitelist-custom-nodes", PACK.name],
        cwd=COMFY, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 180
    while time.time() < deadline:
        try:
            urllib.request.urlopen(url + "/system_stats", timeout=2)
            break
        except OSError:
            if process.poll() is not None:
                break
            time.sleep(1)
    else:
        process.kill()
    if process.poll() is not None:
        pytest.fail("ComfyUI did not start:\n" + (root / "server.log").read_text()[-3000:])
    yield url, root
    process.terminate()
    try:
        process.wait(timeout=20)
    except subprocess.TimeoutExpired:
        process.kill()
    log.close()


def test_pack_loads_without_import_error(server):
    _, root = server
    text = (root / "server.log").read_text()
    assert "IMPORT FAILED" not in "\n".join(l for l in text.splitlines() if PACK.name in l)
    assert PACK.name in text


def test_object_info_lists_every_node(server):
    url, _ = server
    info = json.load(urllib.request.urlopen(url + "/object_info", timeout=30))
    for node_id, cls in NODE_CLASS_MAPPINGS.items():
        assert node_id in info, node_id
        entry = info[node_id]
        assert entry["display_name"] == cls.DISPLAY
        declared = cls.INPUT_TYPES()
        assert list(entry["input"]["required"]) == list(declared["required"])
        assert entry["output"] == list(cls.RETURN_TYPES)
    loader = info["WanEnhancedModelLoader"]["input"]["required"]["model_name"]
    assert "wan2.2_ti2v_5B_fp16.safetensors" in loader[0]


def test_demo_workflow_runs_through_prompt(server, tmp_path):
    url, _ = server
    client = Client(url, timeout=60)
    registry = client.registry()
    workflow = apply_overrides(load_workflow(WORKFLOW), list(DEMO_SETTINGS), registry)
    result = client.run(workflow, tmp_path / "downloads")
    videos = [f for f in result.files if str(f).endswith(".mp4")]
    assert result.status == "success" and len(videos) == 1
    assert Path(videos[0]).stat().st_size > 1000
