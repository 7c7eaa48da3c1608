"""The file a loader names, checked before anything loads: that it is a file of the loader's
model folder (inside ComfyUI nothing else), and that its header holds the kind of model the
loader makes (a VAE given to the model loader is refused by name, not after a failed load).

Reading a header costs a few milliseconds; the answer is kept per file (path, size and time of
change) in a small bounded cache, so validating the same workflow again reads nothing.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

from .. import host
from ..checkpoints.clip_vision import check_clip_vision_keys
from ..checkpoints.detect import COMPONENT_NAMES
from ..checkpoints.loader import CheckpointInfo, inspect_checkpoint
from ..checkpoints.reader import CheckpointError
from ..lora.file import check_lora_keys

# model folder -> the components a file in it may hold
EXPECTED = {
    "diffusion_models": ("dit",),
    "text_encoders": ("t5",),
    "vae": ("vae21", "vae22"),
    "clip_vision": ("clip_vision",),
    "loras": ("lora",),
}
KIND_NAMES = {**COMPONENT_NAMES, "clip_vision": "CLIP vision encoder", "lora": "LoRA"}


def loader_file_problem(folder: str, name, field: str) -> str | None:
    """Why a loader cannot take `name` from `folder` ("field: ..."), or None."""
    if name is None:
        return None  # linked: checked when the loader runs
    try:
        path = host.resolve_model(folder, name)
    except host.ModelNameError as error:
        return f"{field}: {error}"
    if not path.exists():
        listed = host.list_models(folder)
        shown = ", ".join(map(repr, listed[:8])) + (", ..." if len(listed) > 8 else "")
        return f"{field}: {name!r} is not in the '{folder}' model folder ({shown or 'empty'})"
    try:
        kind = file_kind(path, folder)
    except (CheckpointError, OSError) as error:
        return f"{field}: {name!r} cannot be read: {host.hide_server_paths(_reason(error))}"
    if kind not in EXPECTED[folder]:
        wanted = " or ".join(KIND_NAMES[k] for k in EXPECTED[folder])
        return f"{field}: {name!r} holds a {KIND_NAMES.get(kind, kind)}, not a {wanted}"
    return None


def _reason(error: Exception) -> str:
    return str(error) if isinstance(error, CheckpointError) else \
        f"{type(error).__name__}: {getattr(error, 'strerror', None) or error}"


def file_kind(path: Path, folder: str) -> str:
    """The component a model file holds (CheckpointError when it is none of ours)."""
    if folder == "clip_vision":
        check_clip_vision_keys(path)
        return "clip_vision"
    if folder == "loras":
        check_lora_keys(path)
        return "lora"
    try:
        return inspect_model_file(path).component
    except CheckpointError as error:
        for kind, check in (("clip_vision", check_clip_vision_keys), ("lora", check_lora_keys)):
            try:  # name the other kinds a loader is commonly given by mistake
                check(path)
            except (CheckpointError, OSError):
                continue
            return kind
        raise error


def inspect_model_file(path: str | Path) -> CheckpointInfo:
    """What a checkpoint holds and its configuration, from its header (cached per version)."""
    path = Path(path)
    stat = os.stat(path)
    found = _inspect_cached(str(path), stat.st_mtime_ns, stat.st_size)
    if isinstance(found, CheckpointError):
        raise found
    return found


@functools.lru_cache(maxsize=64)
def _inspect_cached(path: str, _mtime_ns: int, _size: int) -> CheckpointInfo | CheckpointError:
    try:
        return inspect_checkpoint(path)
    except CheckpointError as error:
        return CheckpointError(str(error))  # without its traceback: nothing kept alive
