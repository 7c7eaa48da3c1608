"""The package inside a real ComfyUI: it loads without import errors, every node is listed in
/object_info with the inputs we declare, the demo workflow runs through /prompt to an MP4, and
the hostile-workflow corpus (hostile_corpus.py) is refused by /prompt itself at the same node and
input as by our command line, with nothing written and no server path in the answer, and the Wan
LoRA Loader takes LoRAs from ComfyUI's `loras` folder (names only) in both modes.

Needs a host made by ../shared/tools/comfyui-host.sh (COMFYUI_HOME); skipped without one.
"""

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

import hostile_corpus as corpus
from wan_enhanced import NODE_CLASS_MAPPINGS
from wan_enhanced.checkpoints.tiny import TINY_DIT, write_models_folder
from wan_enhanced.lora.tiny import random_lora, write_lora
from wan_enhanced.runner.client import Client, RemoteRunError
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


LORA = "tiny_ti2v_lora.safetensors"


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
    hostile = corpus.make_setting(root / "hostile")
    write_lora(models / "loras" / LORA, random_lora(TINY_DIT["ti2v"], seed=1, alpha=2.0), "kohya")
    config = root / "extra_models.yaml"
    config.write_text("".join(
        f"{name}:\n  base_path: {base}\n  diffusion_models: diffusion_models\n"
        f"  text_encoders: text_encoders\n  vae: vae\n  clip_vision: clip_vision\n"
        f"  loras: loras\n"
        for name, base in (("wan_test", models), ("wan_hostile", hostile.models))))
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
    yield url, root, hostile
    process.terminate()
    try:
        process.wait(timeout=20)
    except subprocess.TimeoutExpired:
        process.kill()
    log.close()


def test_pack_loads_without_import_error(server):
    _, root, _ = server
    text = (root / "server.log").read_text()
    assert "IMPORT FAILED" not in "\n".join(l for l in text.splitlines() if PACK.name in l)
    assert PACK.name in text


def test_object_info_lists_every_node(server):
    url, _, _ = server
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
    url, _, _ = server
    client = Client(url, timeout=60)
    registry = client.registry()
    workflow = apply_overrides(load_workflow(WORKFLOW), list(DEMO_SETTINGS), registry)
    result = client.run(workflow, tmp_path / "downloads")
    videos = [f for f in result.files if str(f).endswith(".mp4")]
    assert result.status == "success" and len(videos) == 1
    assert Path(videos[0]).stat().st_size > 1000


# -- the hostile corpus through /prompt ----------------------------------------------------------

CASES = corpus.cases(corpus.placeholder_setting())


def _post(url: str, workflow: dict) -> tuple[int, dict]:
    body = json.dumps({"prompt": workflow, "client_id": "hostile"}).encode()  # NaN as NaN
    request = urllib.request.Request(url + "/prompt", data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def _names_input(error: dict, name: str) -> bool:
    if error.get("type") == "custom_validation_failed":  # our VALIDATE_INPUTS: "input: problem"
        return f"{name}: " in error.get("details", "")
    return (error.get("extra_info") or {}).get("input_name") == name


def test_base_of_the_corpus_is_accepted(server):
    url, root, hostile = server
    workflow = corpus.base_workflow()
    workflow.pop("9")  # only validation matters here: no run that writes a log
    workflow.pop("11")
    workflow.pop("8")
    workflow["12"] = {"class_type": "WanEnhancedMemoryProbe",
                      "inputs": {"value": ["5", 0], "label": "latent"}}
    status, reply = _post(url, workflow)
    assert status == 200, reply


@pytest.mark.parametrize("name", [c.name for c in CASES if not c.embedded_only])
def test_hostile_case_is_refused_by_comfyui(server, name):
    url, root, hostile = server
    case = next(c for c in corpus.cases(hostile) if c.name == name)
    before = (corpus.tree(root / "out"), corpus.tree(hostile.models),
              hostile.victim.read_text())
    status, reply = _post(url, corpus.only_outputs_reaching(corpus.apply(case), case.node))
    assert status == 400, reply
    errors = reply.get("node_errors", {}).get(case.node, {}).get("errors", [])
    assert any(_names_input(e, case.input) for e in errors), reply
    text = json.dumps(reply)
    for sent in case.changes.values():  # the answer may quote what was posted, nothing more
        text = text.replace(json.dumps(str(sent))[1:-1], "")
    assert str(hostile.models) not in text and str(root / "out") not in text  # no server paths
    assert (corpus.tree(root / "out"), corpus.tree(hostile.models),
            hostile.victim.read_text()) == before
    assert "this must never run" not in (root / "server.log").read_text()


@pytest.mark.parametrize("name, node, message", [
    ("wan21-vae-with-ti2v", "7", "cannot be decoded by vae21.safetensors"),
    ("width-off-ti2v-stride", "5", "width 80 is not a multiple of 32"),
])
def test_cross_node_mistakes_are_refused_by_the_first_node_that_knows(server, tmp_path, name,
                                                                      node, message):
    """/prompt sees one node at a time; the node that can tell refuses when it runs."""
    url, _, hostile = server
    case = next(c for c in corpus.cases(hostile) if c.name == name)
    workflow = corpus.apply(case)
    workflow["9"]["inputs"]["save_log"] = ""
    client = Client(url, timeout=120)
    with pytest.raises(RemoteRunError) as caught:
        client.run(workflow, tmp_path / "downloads")
    assert message in str(caught.value) and f"node {node}" in str(caught.value)


# -- the LoRA loader inside ComfyUI ---------------------------------------------------------------

def _with_lora(workflow: dict, name, mode: str) -> dict:
    """The demo workflow with a Wan LoRA Loader between the model loader and its users."""
    workflow = json.loads(json.dumps(workflow))
    for node in workflow.values():
        for key, value in node["inputs"].items():
            if value == ["1", 0]:
                node["inputs"][key] = ["90", 0]
    workflow["90"] = {"class_type": "WanEnhancedLoRALoader",
                      "inputs": {"model": ["1", 0], "lora_name": name, "strength": 0.8,
                                 "mode": mode}}
    return workflow


def test_lora_loader_lists_the_loras_folder(server):
    url, _, _ = server
    info = json.load(urllib.request.urlopen(url + "/object_info/WanEnhancedLoRALoader",
                                            timeout=30))
    required = info["WanEnhancedLoRALoader"]["input"]["required"]
    assert LORA in required["lora_name"][0]
    assert required["mode"][0] == ["merge", "unmerged"]


@pytest.mark.parametrize("mode", ["merge", "unmerged"])
def test_lora_workflow_runs_through_prompt(server, tmp_path, mode):
    url, _, _ = server
    client = Client(url, timeout=60)
    workflow = apply_overrides(load_workflow(WORKFLOW), list(DEMO_SETTINGS), client.registry())
    result = client.run(_with_lora(workflow, LORA, mode), tmp_path / "downloads")
    videos = [f for f in result.files if str(f).endswith(".mp4")]
    assert result.status == "success" and len(videos) == 1


def test_lora_loader_takes_only_names_of_the_loras_folder(server):
    url, root, _ = server
    workflow = apply_overrides(load_workflow(WORKFLOW), list(DEMO_SETTINGS),
                               Client(url, timeout=60).registry())
    absolute = str(root / "models" / "loras" / LORA)
    for name in (absolute, "../loras/" + LORA, "missing.safetensors"):
        status, reply = _post(url, _with_lora(workflow, name, "merge"))
        assert status == 400, reply
        errors = reply.get("node_errors", {}).get("90", {}).get("errors", [])
        assert any(_names_input(e, "lora_name") for e in errors), reply
        assert str(root) not in json.dumps(reply).replace(json.dumps(absolute)[1:-1], "")
