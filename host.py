"""The only module that touches ComfyUI.

Inside ComfyUI these functions use its model manager, progress bar, interrupt flag and model
folders. Without ComfyUI (our command line, tests, other programs) they fall back to plain
PyTorch, a configurable models folder and output folder, and an interrupt flag of our own.
Importing this module never imports ComfyUI eagerly and never fails.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Callable

import torch

# ComfyUI model folder names -> the subfolder used when running without ComfyUI
MODEL_FOLDERS = ("diffusion_models", "text_encoders", "vae", "loras")
MODEL_EXTENSIONS = (".safetensors", ".pth", ".pt", ".bin", ".ckpt", ".index.json")


def _comfy(module: str):
    """A ComfyUI module, or None outside ComfyUI. Any exception counts as absent: on a machine
    without a GPU driver ComfyUI's model manager raises RuntimeError at import. A worker
    process of the several-GPU group (distributed/worker.py) never touches ComfyUI."""
    if os.environ.get("WAN_ENHANCED_WORKER"):
        return None
    try:
        return __import__(module, fromlist=["_"])
    except Exception:
        return None


def in_comfyui() -> bool:
    return _comfy("folder_paths") is not None and _comfy("comfy.model_management") is not None


# -- ComfyUI's release -------------------------------------------------------------------------

# The ComfyUI releases the host tests run on (tests/test_comfyui_host*.py), oldest first.
TESTED_COMFYUI = ("0.3.64", "0.30.0")


def version_numbers(version: str | None) -> tuple[int, ...] | None:
    """(0, 3, 64) for "0.3.64" or "v0.3.64"; None when it is not such a version."""
    if not isinstance(version, str):
        return None
    parts = version.strip().lstrip("v").split(".")
    if len(parts) < 2 or not all(part.isdigit() for part in parts[:3]):
        return None
    return tuple(int(part) for part in parts[:3])


def comfyui_version() -> str | None:
    """The release of the ComfyUI this process runs in (its comfyui_version module), or None
    outside ComfyUI or where it does not say."""
    version = getattr(_comfy("comfyui_version"), "__version__", None)
    return version if isinstance(version, str) else None


def untested_version_note(version: str | None) -> str | None:
    """One line when `version` is a ComfyUI release outside TESTED_COMFYUI's range, else None
    (also for an unknown version: nothing to say)."""
    numbers = version_numbers(version)
    if numbers is None:
        return None
    oldest, newest = (version_numbers(v) for v in (TESTED_COMFYUI[0], TESTED_COMFYUI[-1]))
    if oldest <= numbers <= newest:
        return None
    return (f"comfyui-wan-enhanced: tested with ComfyUI {TESTED_COMFYUI[0]} to "
            f"{TESTED_COMFYUI[-1]}; this is {version}. The nodes are loaded; report what does "
            f"not work")


# -- ComfyUI's own models ----------------------------------------------------------------------

def native_wan_problem(model) -> str | None:
    """None when `model` (a ComfyUI MODEL, a ModelPatcher) holds one of ComfyUI's own Wan
    models (comfy.ldm.wan), else what it holds, in words."""
    inner = getattr(getattr(model, "model", None), "diffusion_model", None)
    if inner is None:
        return f"a {type(model).__name__}, not a ComfyUI MODEL"
    module = type(inner).__module__
    if module.startswith("comfy.ldm.wan."):
        return None
    return f"a {type(inner).__name__} ({module})"


def with_attention_override(model, make_override: Callable) -> object:
    """A clone of the ModelPatcher `model` whose model sends every attention call to
    make_override(the override installed before, or None) (ComfyUI's
    transformer_options["optimized_attention_override"]); `model` itself is left as it was."""
    patched = model.clone()
    options = patched.model_options.setdefault("transformer_options", {})
    options["optimized_attention_override"] = make_override(
        options.get("optimized_attention_override"))
    return patched


# -- devices and memory ------------------------------------------------------------------------

def compute_device() -> torch.device:
    mm = _comfy("comfy.model_management")
    if mm is not None:
        return mm.get_torch_device()
    forced = os.environ.get("WAN_ENHANCED_DEVICE")
    if forced:
        return torch.device(forced)
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def make_room(bytes_needed: int, device: torch.device) -> None:
    """Ask the host to evict its own models so `bytes_needed` fit on `device`."""
    if device.type != "cuda":
        return
    mm = _comfy("comfy.model_management")
    if mm is not None:
        mm.free_memory(bytes_needed + mm.extra_reserved_memory(), device)
        return
    release_cached_memory()


def make_room_for_pinned(bytes_needed: int) -> None:
    """Before this many bytes of host memory are pinned (block swap's packed blocks): a host
    that manages a pinned-memory budget (ComfyUI 0.30's ensure_pin_budget) lets go of its own
    pins if the system's memory would not hold both. Nothing where the host has no such
    budget."""
    if bytes_needed <= 0:
        return
    mm = _comfy("comfy.model_management")
    ensure = getattr(mm, "ensure_pin_budget", None) if mm is not None else None
    if ensure is not None:
        ensure(bytes_needed)


def unload_host_models() -> None:
    mm = _comfy("comfy.model_management")
    if mm is not None:
        mm.unload_all_models()


def release_cached_memory() -> None:
    """Return the allocator's unused cache to the driver."""
    mm = _comfy("comfy.model_management")
    if mm is not None:
        mm.soft_empty_cache()
    elif torch.cuda.is_available():
        torch.cuda.empty_cache()


# -- interrupts and progress -------------------------------------------------------------------

class Interrupted(Exception):
    """Raised between steps when the run was asked to stop (outside ComfyUI)."""


_interrupt = threading.Event()


def request_interrupt() -> None:
    """Ask the running graph to stop at its next check (signal handlers, the embedded runner)."""
    _interrupt.set()


def clear_interrupt() -> None:
    _interrupt.clear()


def check_interrupt() -> None:
    """Raise if the user asked to stop: ComfyUI's own exception inside ComfyUI."""
    mm = _comfy("comfy.model_management")
    if mm is not None:
        mm.throw_exception_if_processing_interrupted()
    if _interrupt.is_set():
        _interrupt.clear()
        raise Interrupted("interrupted")


# -- the prompt being run -----------------------------------------------------------------------

_headless_prompt: list[str | None] = [None]


def begin_prompt(prompt_id: str) -> None:
    """Headless: the id of the prompt (run) that starts now (our runner calls this)."""
    _headless_prompt[0] = str(prompt_id)


def end_prompt() -> None:
    _headless_prompt[0] = None


def current_prompt_id() -> str | None:
    """The id of the prompt whose node is running: ComfyUI's (its execution context, set around
    every node it runs), else the one our runner began, else None."""
    utils = _comfy("comfy_execution.utils")
    context = utils.get_executing_context() if utils is not None and hasattr(
        utils, "get_executing_context") else None
    if context is not None and getattr(context, "prompt_id", None):
        return str(context.prompt_id)
    return _headless_prompt[0]


ProgressListener = Callable[[str, int, int], None]
_listeners: list[ProgressListener] = []


def add_progress_listener(listener: ProgressListener) -> None:
    """Headless progress: listener(node_label, value, total) on every update."""
    _listeners.append(listener)


def remove_progress_listener(listener: ProgressListener) -> None:
    if listener in _listeners:
        _listeners.remove(listener)


class Progress:
    """A progress bar: ComfyUI's (websocket progress, and its interrupt check) when hosted,
    otherwise the registered listeners."""

    def __init__(self, total: int, label: str = ""):
        self.total, self.label, self.value = total, label, 0
        utils = _comfy("comfy.utils")
        self._bar = utils.ProgressBar(total) if utils is not None else None

    def update_to(self, value: int) -> None:
        self.value = value
        if self._bar is not None:
            self._bar.update_absolute(value, self.total)
        for listener in list(_listeners):
            listener(self.label, value, self.total)


# -- output files ------------------------------------------------------------------------------

OutputListener = Callable[[str, Path, "str | None"], None]
_output_listeners: list[OutputListener] = []


def add_output_listener(listener: OutputListener) -> None:
    """listener(node_id, path, token) just before a node writes an output file (the sweep
    runner's bookkeeping); token: what the file will carry to show who wrote it, or None."""
    _output_listeners.append(listener)


def remove_output_listener(listener: OutputListener) -> None:
    if listener in _output_listeners:
        _output_listeners.remove(listener)


def announce_output(node_id, path: Path, token: str | None = None) -> None:
    for listener in list(_output_listeners):
        listener(str(node_id or ""), Path(path), token)


# -- files -------------------------------------------------------------------------------------

_paths = {"models": os.environ.get("WAN_ENHANCED_MODELS", "models"),
          "output": os.environ.get("WAN_ENHANCED_OUTPUT", "output"),
          "input": os.environ.get("WAN_ENHANCED_INPUT", "input")}


def set_headless_folders(models: str | Path | None = None, output: str | Path | None = None,
                         input: str | Path | None = None):
    """Folders used without ComfyUI: models/<folder>/ for the loaders, the output folder, and
    the input folder LoadImage reads."""
    if models is not None:
        _paths["models"] = str(models)
    if output is not None:
        _paths["output"] = str(output)
    if input is not None:
        _paths["input"] = str(input)


def input_directory() -> Path:
    fp = _comfy("folder_paths")
    if fp is not None:
        return Path(fp.get_input_directory())
    return Path(_paths["input"])


def list_models(folder: str) -> list[str]:
    """Model files of a ComfyUI model folder ("diffusion_models", "text_encoders", "vae",
    "loras", ...)."""
    fp = _comfy("folder_paths")
    if fp is not None:
        try:
            return fp.get_filename_list(folder)
        except KeyError:
            return []
    root = Path(_paths["models"]) / folder
    if not root.is_dir():
        return []
    found = []
    for path in sorted(root.rglob("*")):
        name = path.name
        if path.is_file() and name.endswith(MODEL_EXTENSIONS) and ".partial" not in name:
            if "-of-" in name and not name.endswith(".index.json"):
                continue  # shards are listed through their index
            found.append(path.relative_to(root).as_posix())
        elif path.is_dir() and (path / "config.json").is_file() and any(path.glob("*.safetensors*")):
            found.append(path.relative_to(root).as_posix())  # an official or diffusers folder
    return found


class ModelNameError(ValueError):
    """A loader's file name that names no file of its model folder (or, inside ComfyUI, a path
    outside it); the message names the folder, never a server path."""


def resolve_model(folder: str, name: str) -> Path:
    """The full path of a model file named in a loader.

    Inside ComfyUI only names from the model folder's paths (folder_paths) are taken: a file,
    or a model folder (diffusers / official layout) directly inside one of them; absolute paths
    and '..' are refused, so a workflow cannot make the server open or probe other files.
    Headless (our command line, other programs) a name is looked up under models/<folder>/ and
    an absolute path is used as it is: there the person running the command chose it."""
    from .safe_paths import UnsafePathError, check_inside, name_problem

    fp = _comfy("folder_paths")
    if fp is None:
        candidate = Path(name)
        if candidate.is_absolute():
            return candidate
        if name_problem(name) is not None:
            raise ModelNameError(f"{name!r} is not a file name inside the '{folder}' model "
                                 f"folder (headless, an absolute path is taken as it is)")
        return Path(_paths["models"]) / folder / name
    problem = name_problem(name)
    if problem is not None:
        raise ModelNameError(f"{name!r} is not a name from the '{folder}' model folder: inside "
                             f"ComfyUI a loader takes only those (absolute paths work with the "
                             f"wan-enhanced command line)")
    full = fp.get_full_path(folder, name)
    if full is not None:
        return Path(full)
    for root in _folder_paths(fp, folder):
        candidate = Path(root) / name
        try:
            check_inside(root, candidate, folder, name)
        except UnsafePathError:
            continue
        if candidate.is_dir():
            return candidate
    raise ModelNameError(f"{name!r} is not in the '{folder}' model folder")


def _folder_paths(fp, folder: str) -> list[str]:
    try:
        return list(fp.get_folder_paths(folder))
    except KeyError:
        return []


def hide_server_paths(message: str) -> str:
    """Inside ComfyUI: the message with the server's model, output, input and temp folders
    written as their names ("vae/x.safetensors", "output/..."), so that errors sent to whoever
    posted a workflow do not reveal where the server keeps its files. Unchanged headless."""
    fp = _comfy("folder_paths")
    if fp is None:
        return message
    names: dict[str, str] = {}
    for folder in (*MODEL_FOLDERS, "clip_vision"):
        for root in _folder_paths(fp, folder):
            names.setdefault(root, folder)
    for folder in ("output", "input", "temp"):
        getter = getattr(fp, f"get_{folder}_directory", None)
        if getter is not None:
            names.setdefault(getter(), folder)
    names.setdefault(getattr(fp, "base_path", "") or "", "ComfyUI")
    variants = {}
    for root, folder in names.items():
        if root:
            for form in {str(root), str(Path(root)), os.path.realpath(root)}:
                variants[form.rstrip("/")] = folder
    for root in sorted(variants, key=len, reverse=True):
        if root:
            message = message.replace(root, variants[root])
    return message


def output_directory() -> Path:
    fp = _comfy("folder_paths")
    if fp is not None:
        return Path(fp.get_output_directory())
    return Path(_paths["output"])
