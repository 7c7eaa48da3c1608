"""Wan Enhanced Attention inside a real ComfyUI, on the CPU: a graph of ComfyUI's own nodes
(UNETLoader -> Wan Enhanced Attention -> ModelSamplingSD3 -> KSampler -> SaveLatent, the latent from
EmptyHunyuanLatentVideo) gives the same latent bit for bit as the same graph without our node, in
32-bit and in bf16 compute (ModelComputeDtype), because on a CPU every attention call of
ComfyUI's Wan model reaches our override and goes back to ComfyUI's own function; the server log
says so once per patched run, never for an unpatched one; the base model is left unpatched; a
model that is not one of ComfyUI's Wan models is refused by the node, by name.

A probe in the server (a sitecustomize.py on its PYTHONPATH, written by the fixture) wraps the
attention function of comfy.ldm.wan.model and records every call the Wan model makes (caller,
layouts, dtypes, whether our override was installed and what its counters did), so the test
sees which calls passed through the override, not only that the result came out the same.

Needs a host made by tools/comfyui_host.sh (COMFYUI_HOME); skipped without one. The tiny files
follow tests/test_peer_comfy_e2e.py: a DiT with ComfyUI's fixed text width (4096) so that
ComfyUI detects Wan2.1 T2V, and a umT5 of that width for our text encoder nodes (CONDITIONING).
"""

import dataclasses
import json
import os
import socket
import subprocess
import time
import urllib.request
from collections import Counter
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from wan_enhanced.checkpoints.tiny import TINY_DIT, write_dit, write_text_encoder
from wan_enhanced.runner.client import Client, RemoteRunError
from wan_enhanced.wan.configs import T5Config

HOME = Path(os.environ.get("COMFYUI_HOME", "/nonexistent"))
COMFY = HOME / "ComfyUI"
PYTHON = HOME / "venv" / "bin" / "python"
pytestmark = pytest.mark.skipif(not (COMFY / "main.py").is_file() or not PYTHON.is_file(),
                                reason="no ComfyUI host (set COMFYUI_HOME; see "
                                       "tools/comfyui_host.sh)")
PACK = Path(__file__).resolve().parent.parent
WAN = "tiny_wan2.1_t2v.safetensors"
NOT_WAN = "tiny_hunyuan.safetensors"
TE = "tiny_umt5_4096.safetensors"
# ComfyUI's Wan detection takes text_dim 4096 (tests/test_peer_comfy_e2e.py); 2 blocks of 2
# heads of 128
DIT = dataclasses.replace(TINY_DIT["t2v"], text_dim=4096)
# our text encoder reads its shape from the file: a 4096-wide output is all the DiT needs
UMT5 = T5Config(vocab_size=256, dim=4096, dim_attn=64, dim_ffn=64, num_heads=1, num_layers=2,
                num_buckets=32)
STEPS = 2
HAND_BACK = "Wan Enhanced Attention (auto): ComfyUI's attention takes the calls with "
# the reason pipeline/native_attention.py gives on a CPU, whatever the compute dtype (where the
# kernels can run is asked before what they take)
ON_A_CPU = ("our kernels cannot run here: it needs an NVIDIA Hopper GPU (compute capability "
            "9.0); this runs on cpu")
REASONS = {"fp32": ON_A_CPU, "bf16": ON_A_CPU}

PROBE = r'''
"""Test probe (tests/test_comfyui_host_native_attention.py): each attention call of ComfyUI's
Wan model (comfy.ldm.wan.model's optimized_attention) recorded as one JSON line, then made
unchanged."""
import importlib.abc
import json
import os
import sys

RECORD = os.environ["WAN_ATTENTION_PROBE"]
TARGET = "comfy.ldm.wan.model"


def _tensor(t):
    return {"shape": list(t.shape), "dtype": str(t.dtype).replace("torch.", ""),
            "device": t.device.type, "contiguous": t.is_contiguous()}


def _counts(override):
    def total(name):
        counter = getattr(override, name, None)
        return None if counter is None else sum(counter.values())
    return total("handed_back"), total("ours")


def _probe(attention):
    def probed(q, k, v, heads, *args, **kwargs):
        options = kwargs.get("transformer_options") or {}
        override = options.get("optimized_attention_override")
        before = _counts(override)
        out = attention(q, k, v, heads, *args, **kwargs)
        after = _counts(override)
        plain = (bool, int, float, str, type(None))
        entry = {
            "caller": sys._getframe(1).f_code.co_qualname,
            "function": getattr(attention, "__name__", repr(attention)),
            "heads": heads, "q": _tensor(q), "k": _tensor(k), "v": _tensor(v),
            "out": _tensor(out), "positional": len(args),
            "kwargs": {n: x for n, x in kwargs.items()
                       if n != "transformer_options" and isinstance(x, plain)},
            "options": sorted(options),
            "override": None if override is None else type(override).__name__,
            "mode": getattr(override, "mode", None),
            "handed_back": None if before[0] is None else after[0] - before[0],
            "ours": None if before[1] is None else after[1] - before[1],
        }
        with open(RECORD, "a") as f:
            f.write(json.dumps(entry) + "\n")
        return out
    return probed


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != TARGET:
            return None
        for finder in sys.meta_path:
            if finder is not self and hasattr(finder, "find_spec"):
                spec = finder.find_spec(name, path, target)
                if spec is not None:
                    break
        else:
            return None
        exec_module = spec.loader.exec_module

        def exec_and_probe(module):
            exec_module(module)
            module.optimized_attention = _probe(module.optimized_attention)
        spec.loader.exec_module = exec_and_probe
        return spec


sys.meta_path.insert(0, _Finder())
'''


def write_models(root: Path) -> Path:
    from wan_enhanced.wan.tiny_tokenizer import build_spiece_model

    for folder in ("diffusion_models", "text_encoders"):
        (root / folder).mkdir(parents=True, exist_ok=True)
    write_dit(root / "diffusion_models" / WAN, DIT, "comfy", seed=0)
    write_text_encoder(root / "text_encoders" / TE, "hf", config=UMT5, seed=2,
                       spiece_model=build_spiece_model(256))
    # a HunyuanVideo-family DiT (ComfyUI takes it for HunyuanImage 2.1): only the weights its
    # detection reads; the rest stays unset, the model never runs
    hidden = 128
    gen = torch.Generator().manual_seed(3)
    save_file({name: torch.randn(shape, generator=gen).to(torch.bfloat16) for name, shape in {
        "img_in.proj.weight": (hidden, 16, 1, 2, 2),
        "final_layer.linear.weight": (16 * 4, hidden),
        "txt_in.input_embedder.weight": (hidden, 32),
        "txt_in.individual_token_refiner.blocks.0.norm1.weight": (hidden,),
    }.items()}, str(root / "diffusion_models" / NOT_WAN))
    return root


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("comfy_native_attention")
    models = write_models(root / "models")
    config = root / "extra_models.yaml"
    config.write_text(f"native_attention_test:\n  base_path: {models}\n"
                      f"  diffusion_models: diffusion_models\n  text_encoders: text_encoders\n")
    probe = root / "probe"
    probe.mkdir()
    (probe / "sitecustomize.py").write_text(PROBE)
    record = root / "attention_calls.jsonl"
    record.touch()
    link = COMFY / "custom_nodes" / PACK.name
    if not link.exists():
        link.symlink_to(PACK)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (str(probe), os.environ.get("PYTHONPATH")) if p),
        PYTHONUNBUFFERED="1", WAN_ATTENTION_PROBE=str(record))
    port = _free_port()
    log_path = root / "server.log"
    log = open(log_path, "w")
    started = time.perf_counter()
    process = subprocess.Popen(
        [str(PYTHON), "main.py", "--cpu", "--listen", "127.0.0.1", "--port", str(port),
         "--extra-model-paths-config", str(config), "--output-directory", str(root / "out"),
         "--disable-all-custom-nodes", "--whitelist-custom-nodes", PACK.name],
        cwd=COMFY, stdout=log, stderr=subprocess.STDOUT, env=env)
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
        pytest.fail("ComfyUI did not start:\n" + log_path.read_text()[-3000:])
    print(f"\nComfyUI started in {time.perf_counter() - started:.1f} s")
    yield Host(url, root, log_path, record)
    process.terminate()
    try:
        process.wait(timeout=20)
    except subprocess.TimeoutExpired:
        process.kill()
    log.close()


@dataclasses.dataclass
class Host:
    url: str
    root: Path
    log: Path
    record: Path


@dataclasses.dataclass
class Run:
    latent: torch.Tensor
    log: str  # what the server logged during the run
    calls: list[dict]  # the Wan model's attention calls, as the probe saw them
    seconds: float


def node(class_type, **inputs):
    return {"class_type": class_type, "inputs": inputs}


def graph(patched: bool, compute: str, prefix: str, unet: str = WAN) -> dict:
    """UNETLoader -> [Wan Enhanced Attention] -> [ModelComputeDtype] -> ModelSamplingSD3 ->
    KSampler (2 steps, cfg 1) -> SaveLatent; the conditioning from our text nodes."""
    model = ["1", 0]
    workflow = {"1": node("UNETLoader", unet_name=unet, weight_dtype="default")}
    if patched:
        workflow["2"] = node("WanEnhancedAttentionPatch", model=model, mode="auto")
        model = ["2", 0]
    if compute != "default":
        workflow["3"] = node("ModelComputeDtype", model=model, dtype=compute)
        model = ["3", 0]
    workflow.update({
        "4": node("ModelSamplingSD3", model=model, shift=5.0),
        "5": node("WanEnhancedTextEncoderLoader", text_encoder_name=TE, dtype="fp32",
                  device="cpu"),
        "6": node("WanEnhancedTextEncode", text_encoder=["5", 0], positive="a red fox",
                  negative=""),
        "7": node("EmptyHunyuanLatentVideo", width=64, height=48, length=5, batch_size=1),
        "8": node("KSampler", model=["4", 0], seed=7, steps=STEPS, cfg=1.0,
                  sampler_name="euler", scheduler="simple", positive=["6", 0],
                  negative=["6", 1], latent_image=["7", 0], denoise=1.0),
        "9": node("SaveLatent", samples=["8", 0], filename_prefix=f"native_attention/{prefix}"),
    })
    return workflow


def run(host: Host, workflow: dict, tmp_path: Path) -> Run:
    log_at, record_at = host.log.stat().st_size, host.record.stat().st_size
    result = Client(host.url, timeout=300).run(workflow, tmp_path)
    time.sleep(0.2)  # a margin for the log's last lines (the server writes it unbuffered)
    (path,) = [Path(f) for f in result.files if f.endswith(".latent")]
    with open(host.log, "rb") as f:
        f.seek(log_at)
        log = f.read().decode(errors="replace")
    with open(host.record, "rb") as f:
        f.seek(record_at)
        calls = [json.loads(line) for line in f.read().decode().splitlines()]
    return Run(load_file(str(path))["latent_tensor"], log, calls, result.seconds)


def hand_back_lines(log: str) -> list[str]:
    return [line[line.index(HAND_BACK):] for line in log.splitlines() if HAND_BACK in line]


def without_override(call: dict) -> dict:
    call = {k: v for k, v in call.items() if k not in ("override", "mode", "handed_back",
                                                        "ours")}
    call["options"] = [o for o in call["options"] if o != "optimized_attention_override"]
    return call


def kinds(calls: list[dict]) -> Counter:
    return Counter(c["caller"] for c in calls)


@pytest.mark.parametrize("compute", ["default", "bf16"])
def test_patched_graph_gives_comfyuis_latent_bit_for_bit_on_the_cpu(server, tmp_path, compute):
    name = "fp32" if compute == "default" else compute
    patched = run(server, graph(True, compute, f"patched_{name}"), tmp_path / "patched")
    plain = run(server, graph(False, compute, f"plain_{name}"), tmp_path / "plain")
    print(f"\n{name}: patched run {patched.seconds:.2f} s, unpatched {plain.seconds:.2f} s")
    for call in patched.calls[:1] + [c for c in patched.calls if "Cross" in c["caller"]][:1]:
        print(json.dumps(call))

    # the same latent, bit for bit
    assert patched.latent.shape == plain.latent.shape == (1, 16, 2, 6, 8)
    assert patched.latent.dtype == plain.latent.dtype
    assert torch.equal(patched.latent, plain.latent)
    assert torch.isfinite(patched.latent).all() and patched.latent.abs().sum() > 0

    # every attention call of the Wan model went to our override, and each came back to
    # ComfyUI's function: one self- and one cross-attention per block per step (cfg 1: the
    # positive batch only)
    per_run = STEPS * DIT.num_layers
    expected = {"WanSelfAttention.forward": per_run, "WanT2VCrossAttention.forward": per_run}
    assert kinds(patched.calls) == kinds(plain.calls) == expected
    assert {c["override"] for c in patched.calls} == {"NativeAttention"}
    assert {c["mode"] for c in patched.calls} == {"auto"}
    assert [c["handed_back"] for c in patched.calls] == [1] * 2 * per_run
    assert [c["ours"] for c in patched.calls] == [0] * 2 * per_run
    # the unpatched graph shares the loader's cached model: the patch did not reach it
    assert {c["override"] for c in plain.calls} == {None}
    dtype = "float32" if name == "fp32" else "bfloat16"
    for call in patched.calls:
        assert call["q"]["dtype"] == call["k"]["dtype"] == call["out"]["dtype"] == dtype
        assert call["heads"] == DIT.num_heads and call["q"]["device"] == "cpu"
        assert call["q"]["shape"][-1] == DIT.dim  # [B, L, heads * 128]: no skip_reshape
        assert not call["kwargs"].get("skip_reshape") and call["positional"] == 0
    # the same calls, shapes and dtypes with and without the patch; ComfyUI's transformer
    # options differ only by the override
    assert all("optimized_attention_override" in c["options"] for c in patched.calls)
    assert [without_override(c) for c in patched.calls] == [without_override(c)
                                                            for c in plain.calls]

    # the log says it once for the patched run, never for the other
    assert hand_back_lines(patched.log) == [HAND_BACK + REASONS[name]]
    assert hand_back_lines(plain.log) == []
    assert "Wan Enhanced Attention" not in plain.log


def test_a_model_that_is_not_comfyuis_wan_is_refused_by_name(server, tmp_path):
    before = server.record.stat().st_size
    with pytest.raises(RemoteRunError) as caught:
        Client(server.url, timeout=300).run(graph(True, "default", "refused", unet=NOT_WAN),
                                            tmp_path)
    error = caught.value
    print(f"\nrefused: {error}")
    assert (error.node_id, error.node_type) == ("2", "WanEnhancedAttentionPatch")
    assert error.exception_message.startswith(
        "Wan Enhanced Attention: model: expected one of ComfyUI's Wan models, got a "
        "HunyuanVideo (comfy.ldm.hunyuan_video.")
    assert server.record.stat().st_size == before  # nothing sampled
    assert not list((server.root / "out").glob("native_attention/refused*"))
