"""Inside ComfyUI a loader takes only names from its model folders: an absolute path or a '..'
is refused without looking at the file (so a workflow cannot probe which files the server has),
and the errors name the model folder, not where the server keeps it. Headless (our command line)
an absolute path is still taken as given. ComfyUI's folder_paths is stood in by a small fake
that follows its get_full_path."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from wan_enhanced import host
from wan_enhanced.checkpoints import tiny
from wan_enhanced.nodes import NODE_CLASS_MAPPINGS as NODES
from wan_enhanced.nodes.common import NodeInputError

LOADER, VAE_LOADER = NODES["WanEnhancedModelLoader"], NODES["WanEnhancedVAELoader"]


class FakeFolderPaths:
    """The part of ComfyUI's folder_paths module the package uses."""

    def __init__(self, base: Path):
        self.base_path = str(base)
        self.folders = {name: [str(base / "models" / name)]
                        for name in ("diffusion_models", "text_encoders", "vae", "clip_vision")}
        for paths in self.folders.values():
            Path(paths[0]).mkdir(parents=True, exist_ok=True)

    def get_folder_paths(self, folder):
        return self.folders[folder]

    def get_full_path(self, folder, filename):  # as ComfyUI: '..' and a leading '/' flattened
        filename = os.path.relpath(os.path.join("/", filename), "/")
        for root in self.folders.get(folder, []):
            if os.path.isfile(os.path.join(root, filename)):
                return os.path.join(root, filename)
        return None

    def get_filename_list(self, folder):
        root = Path(self.folders[folder][0])
        return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())

    def get_output_directory(self):
        return str(Path(self.base_path) / "output")

    def get_input_directory(self):
        return str(Path(self.base_path) / "input")

    def get_temp_directory(self):
        return str(Path(self.base_path) / "temp")


@pytest.fixture
def comfy(tmp_path, monkeypatch):
    """A ComfyUI whose models folder holds a tiny TI2V set and a file that is not a model."""
    base = tmp_path / "server" / "ComfyUI"
    fake = FakeFolderPaths(base)
    models = base / "models"
    tiny.write_models_folder(models, dit_name="dit.safetensors", vae_name="vae.safetensors",
                             text_encoder_name="te.safetensors", kind="ti2v")
    (models / "diffusion_models" / "broken.safetensors").write_bytes(b"\x10\x00" + b"x" * 40)
    real_comfy = host._comfy
    monkeypatch.setattr(host, "_comfy",
                        lambda module: fake if module == "folder_paths" else (
                            None if module.startswith("comfy") else real_comfy(module)))
    return fake, models


@pytest.fixture
def secret(tmp_path):
    """A real model file outside every model folder, at an absolute path."""
    path = tmp_path / "private" / "vae.safetensors"
    tiny.write_vae(path, "vae22", "official")
    return path


def test_inside_comfyui_absolute_paths_are_refused_without_probing(comfy, secret):
    there = VAE_LOADER.VALIDATE_INPUTS(str(secret))
    missing = VAE_LOADER.VALIDATE_INPUTS(str(secret.with_name("nothing.safetensors")))
    assert "vae_name" in there and "inside ComfyUI a loader takes only those" in there
    assert "command line" in there
    # the answer is the same whether the file exists or not: nothing to probe with
    assert there.replace("vae.safetensors", "X") == missing.replace("nothing.safetensors", "X")
    with pytest.raises(NodeInputError, match="not a name from the 'vae' model folder"):
        VAE_LOADER().load(str(secret), "fp32")


@pytest.mark.parametrize("name", ["../diffusion_models/dit.safetensors",
                                  "sub/../../vae/vae.safetensors", "..\\vae\\vae.safetensors"])
def test_inside_comfyui_dot_dot_is_refused(comfy, name):
    problem = LOADER.VALIDATE_INPUTS(name)
    assert problem.startswith("model_name: ") and "inside ComfyUI" in problem


def test_inside_comfyui_names_from_the_folder_load(comfy):
    _, models = comfy
    assert LOADER.VALIDATE_INPUTS("dit.safetensors") is True
    assert VAE_LOADER.VALIDATE_INPUTS("vae.safetensors") is True
    (handle,) = VAE_LOADER().load("vae.safetensors", "fp32")
    assert Path(handle.info.path) == models / "vae" / "vae.safetensors"


def test_inside_comfyui_errors_name_the_folder_not_the_server_path(comfy, tmp_path):
    problem = LOADER.VALIDATE_INPUTS("broken.safetensors")
    assert "cannot be read" in problem and "diffusion_models/broken.safetensors" in problem
    assert str(tmp_path) not in problem
    with pytest.raises(NodeInputError) as caught:
        LOADER().load("broken.safetensors", "fp32", "sdpa")
    assert str(tmp_path) not in str(caught.value)
    assert "diffusion_models/broken.safetensors" in str(caught.value)


def test_inside_comfyui_a_file_of_the_wrong_kind_is_named(comfy):
    _, models = comfy
    os.link(models / "vae" / "vae.safetensors", models / "diffusion_models" / "a_vae.safetensors")
    problem = LOADER.VALIDATE_INPUTS("a_vae.safetensors")
    assert problem == ("model_name: 'a_vae.safetensors' holds a Wan2.2 VAE, not a Wan "
                       "diffusion model (DiT)")


def test_headless_absolute_paths_still_work(secret, tmp_path):
    host.set_headless_folders(models=tmp_path / "models")
    try:
        assert VAE_LOADER.VALIDATE_INPUTS(str(secret)) is True
        (handle,) = VAE_LOADER().load(str(secret), "fp32")
        assert Path(handle.info.path) == secret
        assert "inside the 'vae' model folder" in VAE_LOADER.VALIDATE_INPUTS("../x.safetensors")
    finally:
        host.set_headless_folders(models="models")
