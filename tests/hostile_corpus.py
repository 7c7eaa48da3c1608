"""A corpus of hostile and mistaken workflows, shared by the in-process test
(test_hostile_workflows.py) and the test against a real ComfyUI (test_comfyui_host.py).

Every case changes one input of a valid base workflow (the speed preview on tiny models, with a
memory probe that saves its log and a CLIP vision loader) and names the node and input that must
be refused: path traversal and absolute paths in every path-like input, NaN, infinity and huge
numbers in every numeric input, oversized videos and files of the wrong kind.
"""

from __future__ import annotations

import copy
import json
import math
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch

from wan_enhanced.checkpoints import tiny
from wan_enhanced.nodes import NODE_CLASS_MAPPINGS as NODES

WORKFLOW = Path(__file__).resolve().parent.parent / "api_workflows" / \
    "wan22_ti2v_5b_speed_preview.json"
DIT, VAE, TE, CLIP = "dit.safetensors", "vae.safetensors", "te.safetensors", "clip.safetensors"
TINY_CLIP = dict(hidden=64, layers=2, heads=1, intermediate=128, image_size=28, patch=14)
PATH_INPUTS = {"1": "model_name", "2": "text_encoder_name", "3": "vae_name", "10": "clip_name",
               "8": "filename_prefix", "9": "save_log"}
LOADER_FOLDERS = {"1": "diffusion_models", "2": "text_encoders", "3": "vae", "10": "clip_vision"}
NUMBERS = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf, "1e308": 1e308,
           "10**30": 10 ** 30, "-10**30": -10 ** 30}


@dataclass(frozen=True)
class Case:
    name: str
    changes: dict  # "node.input" -> value
    node: str  # the node and input the refusal must name
    input: str
    embedded_only: bool = False  # decided across nodes: ComfyUI refuses it when a node runs
    headless_allowed: bool = False  # an absolute model path: taken by our command line only


@dataclass
class Setting:
    """The models folder of a corpus run and the files the cases point at."""

    models: Path
    victim: Path  # a file outside every folder the package may touch
    real_models: dict = field(default_factory=dict)  # folder -> absolute path of a real model


def placeholder_setting() -> Setting:
    """Paths that exist nowhere: enough to list the cases (their names and what they name)."""
    nowhere = Path("/nonexistent")
    return Setting(nowhere / "models", nowhere / "victim.txt",
                   {folder: nowhere / folder / "model" for folder in LOADER_FOLDERS.values()})


def make_setting(root: Path) -> Setting:
    models = root / "models"
    tiny.write_models_folder(models, dit_name=DIT, vae_name=VAE, text_encoder_name=TE,
                             kind="ti2v")
    tiny.write_vae(models / "vae" / "vae21.safetensors", "vae21", "official")
    (models / "clip_vision").mkdir(exist_ok=True)
    tiny.write_clip_vision(models / "clip_vision" / CLIP, TINY_CLIP)
    wrong = {"diffusion_models/a_vae.safetensors": "vae/vae.safetensors",
             "diffusion_models/a_clip.safetensors": f"clip_vision/{CLIP}",
             "vae/a_dit.safetensors": f"diffusion_models/{DIT}",
             "vae/a_text_encoder.safetensors": f"text_encoders/{TE}",
             "text_encoders/a_vae.safetensors": "vae/vae.safetensors",
             "clip_vision/a_vae.safetensors": "vae/vae.safetensors"}
    for target, source in wrong.items():
        shutil.copyfile(models / source, models / target)
    (models / "vae" / "notes.safetensors").write_text("not a checkpoint at all\n")
    # a PyTorch checkpoint (torch.save's zip) renamed .safetensors
    torch.save({"patch_embedding.weight": torch.zeros(1)},
               models / "diffusion_models" / "renamed_pt.safetensors")
    _write_payload(models / "vae" / "payload.pth")
    victim = root / "victim.txt"
    victim.write_text("precious\n")
    real = {folder: models / folder / name for folder, name in
            (("diffusion_models", DIT), ("text_encoders", TE), ("vae", VAE),
             ("clip_vision", CLIP))}
    return Setting(models, victim, real)


class _Run:
    def __reduce__(self):
        return (os.system, ("echo this must never run",))


def _write_payload(path: Path) -> None:
    torch.save({"decoder.conv1.weight": torch.zeros(1), "run": _Run()}, path)


def base_workflow() -> dict:
    """The valid workflow every case starts from (tiny sizes, CPU dtypes)."""
    workflow = json.loads(WORKFLOW.read_text())
    workflow["1"]["inputs"].update(model_name=DIT, weight_dtype="fp32")
    workflow["2"]["inputs"].update(text_encoder_name=TE, dtype="fp32", device="cpu")
    workflow["3"]["inputs"].update(vae_name=VAE, dtype="fp32")
    workflow["5"]["inputs"].update(width=64, height=64, frames=5)
    workflow["6"]["inputs"].update(steps=1)
    workflow["9"] = {"class_type": "WanEnhancedMemoryProbe",
                     "inputs": {"value": ["7", 0], "label": "decoded", "save_log": "runs/a.json"}}
    workflow["10"] = {"class_type": "WanEnhancedCLIPVisionLoader",
                      "inputs": {"clip_name": CLIP, "dtype": "fp32"}}
    workflow["11"] = {"class_type": "WanEnhancedMemoryProbe",
                      "inputs": {"value": ["10", 0], "label": "clip"}}
    return workflow


def apply(case: Case) -> dict:
    workflow = copy.deepcopy(base_workflow())
    for key, value in case.changes.items():
        node_id, name = key.split(".")
        workflow[node_id]["inputs"][name] = value
    return workflow


OUTPUTS = ("8", "9", "11")


def only_outputs_reaching(workflow: dict, node: str) -> dict:
    """The workflow without the output nodes that do not depend on `node` (and the nodes only
    they need). ComfyUI queues the outputs that validate and runs them beside the refused
    ones; a test of one refusal keeps only the outputs it refuses, so that nothing runs."""
    outputs = [out for out in OUTPUTS if _depends(workflow, out, node)]
    return {k: v for k, v in workflow.items() if any(_depends(workflow, out, k) for out in outputs)}


def _depends(workflow: dict, output: str, node: str) -> bool:
    stack, seen = [output], set()
    while stack:
        current = stack.pop()
        if current == node:
            return True
        if current in seen or current not in workflow:
            continue
        seen.add(current)
        stack += [v[0] for v in workflow[current]["inputs"].values() if isinstance(v, list)]
    return False


def cases(setting: Setting) -> list[Case]:
    return (_traversal_cases(setting) + _number_cases() + _oversized_cases()
            + _wrong_kind_cases() + _cross_node_cases())


def _traversal_cases(setting: Setting) -> list[Case]:
    found = []
    for node, name in PATH_INPUTS.items():
        loader = node in LOADER_FOLDERS
        values = {"dotdot": "../../victim.txt", "dotdot-inner": "a/../../../victim.json",
                  "backslash": "..\\..\\victim.json", "absolute": str(setting.victim)}
        if loader:
            values["sibling-folder"] = "../vae/" + VAE
        else:
            values["absolute-json"] = str(setting.victim.with_suffix(".json"))
        for kind, value in values.items():
            found.append(Case(f"{name}-{kind}", {f"{node}.{name}": value}, node, name))
        if loader:
            real = setting.real_models[LOADER_FOLDERS[node]]
            found.append(Case(f"{name}-absolute-real-model", {f"{node}.{name}": str(real)}, node,
                              name, headless_allowed=True))
    return found


def _number_cases() -> list[Case]:
    found = []
    for node in ("5", "6", "7", "8"):
        cls = NODES[base_workflow()[node]["class_type"]]
        declared = cls.INPUT_TYPES()
        for name, spec in {**declared["required"], **declared.get("optional", {})}.items():
            if spec[0] not in ("INT", "FLOAT"):
                continue
            for label, value in NUMBERS.items():
                found.append(Case(f"{name}={label}", {f"{node}.{name}": value}, node, name))
    return found


def _oversized_cases() -> list[Case]:
    return [
        Case("video-8192x8192x4097", {"5.width": 8192, "5.height": 8192, "5.frames": 4097},
             "5", "frames"),
        Case("video-8192x8192x1025", {"5.width": 8192, "5.height": 8192, "5.frames": 1025},
             "5", "frames"),
        Case("video-batch-64", {"5.width": 8192, "5.height": 8192, "5.frames": 81,
                                "5.batch": 64}, "5", "frames"),
    ]


def _wrong_kind_cases() -> list[Case]:
    return [Case(f"{name}-{value}", {f"{node}.{name}": value}, node, name)
            for node, name, value in (
        ("1", "model_name", "a_vae.safetensors"), ("1", "model_name", "a_clip.safetensors"),
        ("1", "model_name", "renamed_pt.safetensors"),
        ("3", "vae_name", "a_dit.safetensors"), ("3", "vae_name", "a_text_encoder.safetensors"),
        ("3", "vae_name", "notes.safetensors"), ("3", "vae_name", "payload.pth"),
        ("2", "text_encoder_name", "a_vae.safetensors"),
        ("10", "clip_name", "a_vae.safetensors"))]


def _cross_node_cases() -> list[Case]:
    return [Case("wan21-vae-with-ti2v", {"3.vae_name": "vae21.safetensors"}, "7", "vae",
                 embedded_only=True),
            Case("width-off-ti2v-stride", {"5.width": 80}, "5", "width", embedded_only=True)]


def tree(folder: Path) -> dict:
    """Every file under `folder` with its size and time of change (to show nothing moved)."""
    if not folder.exists():
        return {}
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(folder.rglob("*"))}
