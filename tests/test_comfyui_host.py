"""The package inside a real ComfyUI: it loads without import errors, every node is listed in
/object_info with the inputs we declare, every workflow of api_workflows/ runs through /prompt to
decodable MP4s on tiny models, graphs that mix ComfyUI's own nodes with ours run, the
broken-graph corpus is refused by /prompt and by our validator with the same verdict, and the
hostile-workflow corpus (hostile_corpus.py) is refused by /prompt itself at the same node and
input as by our command line, with nothing written and no server path in the answer, and the Wan
LoRA Loader takes LoRAs from ComfyUI's `loras` folder (names only) in both modes.

Needs a host made by tools/comfyui_host.sh (COMFYUI_HOME); skipped without one.
"""

import json
import os
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

import hostile_corpus as corpus
from wan_enhanced import NODE_CLASS_MAPPINGS
from wan_enhanced.checkpoints.tiny import (TINY_DIT, write_clip_vision, write_dit,
                                           write_models_folder, write_vae)
from wan_enhanced.lora.tiny import lightx2v_lora, random_lora, write_lora
from wan_enhanced.pipeline.video_io import read_mp4
from wan_enhanced.runner.client import Client, PromptRejected, RemoteRunError
from wan_enhanced.runner.demo_command import DEMO_SETTINGS, WORKFLOW
from wan_enhanced.runner.headless_nodes import local_registry
from wan_enhanced.runner.overrides import apply_overrides
from wan_enhanced.runner.workflow import WorkflowError, load_workflow, validate

HOME = Path(os.environ.get("COMFYUI_HOME", "/nonexistent"))
COMFY = HOME / "ComfyUI"
PYTHON = HOME / "venv" / "bin" / "python"
pytestmark = pytest.mark.skipif(not (COMFY / "main.py").is_file() or not PYTHON.is_file(),
                                reason="no ComfyUI host (set COMFYUI_HOME; see "
                                       "tools/comfyui_host.sh)")
PACK = Path(__file__).resolve().parent.parent
API_WORKFLOWS = sorted((PACK / "api_workflows").glob("*.json"))
TE = "umt5_xxl_fp16.safetensors"
# every model file the workflows name, as a tiny model of its kind
DITS = {"wan2.2_ti2v_5B_fp16.safetensors": ("ti2v", "wan2.2_vae.safetensors"),
        "wan2.1_t2v_1.3B_fp16.safetensors": ("t2v", "wan_2.1_vae.safetensors"),
        "wan2.2_i2v_high_noise_14B_fp16.safetensors": ("i2v_a14b", "wan_2.1_vae.safetensors"),
        "wan2.2_i2v_low_noise_14B_fp16.safetensors": ("i2v_a14b", "wan_2.1_vae.safetensors"),
        "wan2.1_i2v_480p_14B_fp16.safetensors": ("i2v", "wan_2.1_vae.safetensors")}
TINY_CLIP = dict(hidden=64, layers=2, heads=1, intermediate=128, image_size=28, patch=14)
# ComfyUI's VAE loader builds the released Wan2.1 VAE's shape whatever the file holds
NATIVE_VAE = "native_wan21_vae.safetensors"
# the LoRA workflow's A14B T2V experts and their LoRAs, and a LoRA of the TI2V demo model
LORA_EXPERTS = {"wan2.2_t2v_high_noise_14B_fp8_scaled.safetensors":
                "wan2.2_t2v_lightx2v_4steps_lora_v1.1_high_noise.safetensors",
                "wan2.2_t2v_low_noise_14B_fp8_scaled.safetensors":
                "wan2.2_t2v_lightx2v_4steps_lora_v1.1_low_noise.safetensors"}
LORA = "tiny_ti2v_lora.safetensors"
# the distill workflows' models and LightX2V step-distill LoRAs (its extractor's layout)
DISTILL = {"wan2.1_t2v_14B_fp8_scaled.safetensors":
           ("t2v", "lightx2v_t2v_14b_cfg_step_distill_v2_lora_rank64_bf16.safetensors"),
           "wan2.2_ti2v_5B_fp16.safetensors":
           ("ti2v", "wan2.2_ti2v_5b_lightx2v_4step_lora_rank64.safetensors")}


def write_model_set(root: Path) -> Path:
    for dit, (kind, vae) in DITS.items():
        write_models_folder(root, dit_name=dit, vae_name=vae, text_encoder_name=TE, kind=kind)
    write_clip_vision(root / "clip_vision" / "clip_vision_h.safetensors", TINY_CLIP)
    write_vae(root / "vae" / NATIVE_VAE, "vae21", config={"dim": 96, "z_dim": 16},
              dtype=torch.float16)
    for seed, (expert, lora) in enumerate(LORA_EXPERTS.items()):
        write_dit(root / "diffusion_models" / expert, TINY_DIT["t2v"], "comfy_fp8", seed=seed)
        write_lora(root / "loras" / lora, random_lora(TINY_DIT["t2v"], seed=seed), "generic")
    write_lora(root / "loras" / LORA, random_lora(TINY_DIT["ti2v"], seed=1, alpha=2.0), "kohya")
    for seed, (dit, (kind, lora)) in enumerate(DISTILL.items()):
        if not (root / "diffusion_models" / dit).exists():
            write_dit(root / "diffusion_models" / dit, TINY_DIT[kind], "comfy_fp8", seed=seed)
        write_lora(root / "loras" / lora,
                   lightx2v_lora(TINY_DIT[kind], seed=seed, rank=4, pair_min=256), "lightx2v")
    return root


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("comfy")
    models = write_model_set(root / "models")
    hostile = corpus.make_setting(root / "hostile")
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
        assert entry["output"] == [str(t) for t in cls.RETURN_TYPES]
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


# -- every shipped workflow through /prompt -------------------------------------------------------

SMALL = {"WanEnhancedEmptyLatent": {"width": 64, "height": 32, "frames": 5},
         "WanEnhancedImageToVideoLatent": {"width": 64, "height": 32, "frames": 5},
         "WanEnhancedSampler": {"steps": 2}}


def small(workflow: dict) -> dict:
    """The workflow at a size a CPU runs in seconds on the tiny models."""
    for node in workflow.values():
        node["inputs"].update(SMALL.get(node["class_type"], {}))
    return workflow


@pytest.mark.parametrize("path", API_WORKFLOWS, ids=lambda p: p.stem)
def test_every_workflow_runs_through_prompt_to_a_decodable_video(server, tmp_path, path):
    url, _, _ = server
    workflow = small(json.loads(path.read_text()))
    result = Client(url, timeout=120).run(workflow, tmp_path / "downloads")
    videos = [Path(f) for f in result.files if f.endswith(".mp4")]
    savers = [n for n in workflow.values()
              if n["class_type"] in ("WanEnhancedSaveVideo", "WanEnhancedDecodeSaveVideo")]
    assert result.status == "success" and len(videos) == len(savers) >= 1
    for video in videos:
        frames, _ = read_mp4(video)
        assert tuple(frames.shape) == (5, 32, 64, 3)


# -- graphs that mix ComfyUI's nodes with ours -----------------------------------------------------

def node(class_type, **inputs):
    return {"class_type": class_type, "inputs": inputs}


def ours_until_sampling(dit: str, vae: str) -> dict:
    return {
        "1": node("WanEnhancedModelLoader", model_name=dit, weight_dtype="fp32",
                  attention="sdpa"),
        "2": node("WanEnhancedTextEncoderLoader", text_encoder_name=TE, dtype="fp32",
                  device="cpu"),
        "3": node("WanEnhancedVAELoader", vae_name=vae, dtype="fp32"),
        "4": node("WanEnhancedTextEncode", text_encoder=["2", 0], positive="a fox",
                  negative="blurry"),
    }


def test_our_latent_decodes_in_comfyuis_vae_decode_and_our_frames_save_natively(server,
                                                                               tmp_path):
    url, _, _ = server
    workflow = ours_until_sampling("wan2.1_t2v_1.3B_fp16.safetensors", "wan_2.1_vae.safetensors")
    workflow.update({
        "5": node("WanEnhancedEmptyLatent", model=["1", 0], width=64, height=32, frames=5,
                  batch=1),
        "6": node("WanEnhancedSampler", model=["1", 0], positive=["4", 0], negative=["4", 1],
                  latent=["5", 0], seed=1, steps=2, cfg=3.0, shift=5.0, scheduler="unipc",
                  denoise=1.0),
        "7": node("VAELoader", vae_name=NATIVE_VAE),
        "8": node("VAEDecode", samples=["6", 0], vae=["7", 0]),
        "9": node("SaveAnimatedWEBP", images=["8", 0], filename_prefix="mixed/native_decode",
                  fps=8.0, lossless=False, quality=50, method="fastest"),
        "10": node("WanEnhancedTiledDecode", vae=["3", 0], latent=["6", 0], tile_x=272,
                   tile_y=272, stride_x=144, stride_y=128, mode="untiled"),
        "11": node("SaveImage", images=["10", 0], filename_prefix="mixed/our_frames"),
    })
    result = Client(url, timeout=300).run(workflow, tmp_path)
    files = [Path(f) for f in result.files]
    assert len([f for f in files if f.suffix == ".webp"]) == 1
    assert len([f for f in files if f.suffix == ".png" and "our_frames" in f.name]) == 5
    from PIL import Image
    with Image.open(next(f for f in files if f.suffix == ".webp")) as webp:
        assert webp.size == (64, 32) and webp.n_frames == 5  # ComfyUI's decode of our latent


def test_comfyuis_image_to_video_conditioning_drives_our_sampler(server, tmp_path):
    """WanImageToVideo (ComfyUI's VAE encodes the start image into concat_latent_image and
    concat_mask) feeding the Wan Sampler with an I2V-A14B expert."""
    url, _, _ = server
    workflow = ours_until_sampling("wan2.2_i2v_high_noise_14B_fp16.safetensors",
                                   "wan_2.1_vae.safetensors")
    workflow.update({
        "5": node("LoadImage", image="example.png"),
        "6": node("VAELoader", vae_name=NATIVE_VAE),
        "7": node("WanImageToVideo", positive=["4", 0], negative=["4", 1], vae=["6", 0],
                  width=64, height=32, length=5, batch_size=1, start_image=["5", 0]),
        "8": node("WanEnhancedSampler", model=["1", 0], positive=["7", 0], negative=["7", 1],
                  latent=["7", 2], seed=1, steps=2, cfg=3.0, shift=5.0, scheduler="unipc",
                  denoise=1.0),
        "9": node("WanEnhancedTiledDecode", vae=["3", 0], latent=["8", 0], tile_x=272,
                  tile_y=272, stride_x=144, stride_y=128, mode="untiled"),
        "10": node("WanEnhancedSaveVideo", images=["9", 0], filename_prefix="mixed/i2v",
                   fps=16.0, crf=19),
    })
    result = Client(url, timeout=300).run(workflow, tmp_path)
    (video,) = [Path(f) for f in result.files if f.endswith(".mp4")]
    frames, _ = read_mp4(video)
    assert tuple(frames.shape) == (5, 32, 64, 3)
    # the same conditioning on a text-to-video model is refused by name, not ignored
    workflow["1"]["inputs"]["model_name"] = "wan2.1_t2v_1.3B_fp16.safetensors"
    with pytest.raises(RemoteRunError, match="concat_latent_image.*has no image input"):
        Client(url, timeout=300).run(workflow, tmp_path)


# -- broken graphs: refused by ComfyUI and by our validator alike ---------------------------------

def broken_cases() -> dict:
    def base():
        workflow = ours_until_sampling("wan2.1_t2v_1.3B_fp16.safetensors",
                                       "wan_2.1_vae.safetensors")
        workflow.update({
            "5": node("WanEnhancedEmptyLatent", model=["1", 0], width=64, height=32, frames=5,
                      batch=1),
            "6": node("WanEnhancedSampler", model=["1", 0], positive=["4", 0],
                      negative=["4", 1], latent=["5", 0], seed=1, steps=2, cfg=3.0, shift=5.0,
                      scheduler="unipc", denoise=1.0),
            "7": node("WanEnhancedTiledDecode", vae=["3", 0], latent=["6", 0], tile_x=272,
                      tile_y=272, stride_x=144, stride_y=128, mode="untiled"),
            "8": node("SaveImage", images=["7", 0], filename_prefix="broken"),
        })
        return workflow

    def change(edit):
        workflow = base()
        edit(workflow)
        return workflow

    return {  # name: (workflow, the (node, input) pairs both must name)
        "our VAE into ComfyUI's VAEDecode": (change(lambda w: w.update({"7": node(
            "VAEDecode", samples=["6", 0], vae=["3", 0])})), {("7", "vae")}),
        "a VAE where the model goes": (change(lambda w: w["5"]["inputs"].update(
            model=["3", 0])), {("5", "model")}),
        "required input missing": (change(lambda w: w["6"]["inputs"].pop("seed")),
                                   {("6", "seed")}),
        "steps below the minimum": (change(lambda w: w["6"]["inputs"].update(steps=0)),
                                    {("6", "steps")}),
        "a scheduler not offered": (change(lambda w: w["6"]["inputs"].update(
            scheduler="ddim")), {("6", "scheduler")}),
        "text for a number": (change(lambda w: w["6"]["inputs"].update(seed="abc")),
                              {("6", "seed")}),
        "a latent into an image input": (change(lambda w: w["8"]["inputs"].update(
            images=["6", 0])), {("8", "images")}),
        "a width off the stride": (change(lambda w: w["5"]["inputs"].update(width=72)),
                                   {("5", "width")}),
        "unknown node type": (change(lambda w: w.update({"9": node("NoSuchNode")})), set()),
        "no output node": (change(lambda w: w.pop("8")), set()),
    }


def _comfyui_verdict(url: str, workflow: dict) -> tuple[int, set]:
    status, reply = _post(url, workflow)
    named = set()
    for node_id, info in (reply.get("node_errors") or {}).items():
        for error in info.get("errors", []):
            name = (error.get("extra_info") or {}).get("input_name")
            if error.get("type") == "custom_validation_failed":  # ours: "input: problem"
                name = error.get("details", "").split(" - ", 1)[-1].split(": ", 1)[0]
            named.add((node_id, name))
    return status, named


@pytest.mark.parametrize("name", list(broken_cases()))
def test_a_broken_graph_gets_the_same_verdict_from_comfyui_and_from_us(server, name):
    url, root, _ = server
    workflow, expected = broken_cases()[name]
    status, comfy = _comfyui_verdict(url, workflow)
    registry = {**Client(url).registry(), **local_registry()}
    from wan_enhanced import host
    host.set_headless_folders(models=root / "models")  # the files the server's loaders list
    try:
        with pytest.raises(WorkflowError) as caught:
            validate(workflow, registry)
    finally:
        host.set_headless_folders(models="models")
    ours = {(issue.node_id, issue.input_name) for issue in caught.value.errors
            if issue.input_name is not None}
    assert status == 400
    assert comfy == ours == expected, (comfy, [str(i) for i in caught.value.errors])


def test_our_client_places_a_verdict_at_the_input_it_names(server, tmp_path):
    """ComfyUI files a VALIDATE_INPUTS verdict under every input the check names (the latent's
    check names width, height, frames and batch); `run --server` reports it once, at frames."""
    url, _, _ = server
    workflow = corpus.base_workflow()
    workflow["5"]["inputs"]["frames"] = 6
    workflow = corpus.only_outputs_reaching(workflow, "5")
    status, reply = _post(url, workflow)
    assert status == 400, reply
    filed = {(e.get("extra_info") or {}).get("input_name")
             for e in reply["node_errors"]["5"]["errors"]}
    assert filed == {"width", "height", "frames", "batch"}
    with pytest.raises(PromptRejected) as caught:
        Client(url, timeout=60).run(workflow, tmp_path)
    assert [(i.node_id, i.input_name) for i in caught.value.errors] == [("5", "frames")]
    assert "6 is not of the form 4n+1" in caught.value.errors[0].message


def test_each_prompt_writes_its_own_event_log_with_its_id(server, tmp_path):
    url, root, _ = server
    workflow = {"1": node("WanEnhancedMemoryProbe", value="anything", label="here",
                          save_log="prompt_logs/probe.json")}
    client = Client(url, timeout=60)
    for _ in range(2):
        result = client.run(workflow, tmp_path)
        log = json.loads((root / "out" / "prompt_logs" / "probe.json").read_text())
        assert log["run"]["prompt_id"] == result.prompt_id
        assert [e["label"] for e in log["events"]] == ["here"]  # nothing of earlier prompts


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
