"""ComfyUI's own nodes that our workflows start from, for the in-process runner: the same id,
inputs and outputs, so one workflow file runs in ComfyUI and with `wan-enhanced run`. They are
never registered with ComfyUI (its own nodes are used there)."""

from __future__ import annotations

from pathlib import Path

from .. import host
from ..pipeline.errors import InputError
from ..pipeline.image_io import load_image
from ..safe_paths import name_problem

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif", ".tif", ".tiff")


class LoadImage:
    """ComfyUI's LoadImage: a file of the input folder (headless also an absolute path) as
    IMAGE and MASK."""

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"image": (input_images(), {"image_upload": True})}}

    RETURN_TYPES = ("IMAGE", "MASK")
    FUNCTION = "load_image"
    CATEGORY = "image"

    @classmethod
    def VALIDATE_INPUTS(cls, image):
        try:
            path = image_path(image)
        except InputError as error:
            return str(error)
        return True if path.is_file() else (f"image: {image!r} is not a file of the input "
                                            f"folder {host.input_directory()}")

    def load_image(self, image):
        return load_image(image_path(image))


def input_images() -> list[str]:
    root = host.input_directory()
    if not root.is_dir():
        return []
    return sorted(p.name for p in root.iterdir()
                  if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)


def image_path(name) -> Path:
    """A name in the input folder, or an absolute path (the command line's user chose it)."""
    if not isinstance(name, str) or not name:
        raise InputError(f"image: expected a file name, got {name!r}")
    if Path(name).is_absolute():
        return Path(name)
    problem = name_problem(name)
    if problem is not None:
        raise InputError(f"image: {problem}")
    return host.input_directory() / name


HEADLESS_NODES = {"LoadImage": LoadImage}


def local_registry() -> dict[str, type]:
    """This package's nodes and the stand-ins above: what `wan-enhanced run` runs."""
    from .. import NODE_CLASS_MAPPINGS  # read at call time: the registry fills in as nodes load
    return {**HEADLESS_NODES, **NODE_CLASS_MAPPINGS}
