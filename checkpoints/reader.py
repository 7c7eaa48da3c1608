"""Reading checkpoint files tensor by tensor.

Sources expose the key list, shapes and dtypes without reading any weights (safetensors headers,
the shard index), then hand out one tensor at a time converted to the requested dtype, so a model
is never held twice in memory while it loads.

Supported: a single .safetensors file; sharded safetensors (`*.safetensors.index.json`, a shard
of such a set, or a folder holding one); official .pth/.pt/.bin files, opened only with
`torch.load(weights_only=True)`.
"""

from __future__ import annotations

import json
import pickle
import re
from pathlib import Path

import torch
from safetensors import safe_open


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message names the file and what was expected."""


_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
if hasattr(torch, "float8_e8m0fnu"):  # mxfp8 block scales (ComfyUI's mixed-precision files)
    _SAFETENSORS_DTYPES["F8_E8M0"] = torch.float8_e8m0fnu


class TensorSource:
    """Keys, shapes and dtypes of a checkpoint, and tensors read one at a time."""

    path: Path

    def keys(self) -> list[str]:
        raise NotImplementedError

    def shape(self, key: str) -> tuple[int, ...]:
        raise NotImplementedError

    def dtype(self, key: str) -> torch.dtype:
        raise NotImplementedError

    def read(self, key: str) -> torch.Tensor:
        raise NotImplementedError

    @property
    def metadata(self) -> dict[str, str]:
        return {}

    def metadata_sets(self) -> list[dict[str, str]]:
        """The metadata of each file of the checkpoint (a sharded set has one per shard)."""
        return [self.metadata]

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {k: self.shape(k) for k in self.keys()}


class SafetensorsSource(TensorSource):

    def __init__(self, path: Path):
        self.path = path
        try:
            self._file = safe_open(str(path), framework="pt", device="cpu")
            self._keys = list(self._file.keys())
            self._meta = self._file.metadata() or {}
            self._info = {}
            for key in self._keys:
                part = self._file.get_slice(key)
                self._info[key] = (tuple(part.get_shape()), part.get_dtype())
        except Exception as exc:  # the library raises its own error type for damaged files
            raise CheckpointError(f"{path}: {_not_safetensors(path, exc)}") from exc

    def keys(self):
        return self._keys

    def shape(self, key):
        return self._info[key][0]

    def dtype(self, key):
        name = self._info[key][1]
        if name not in _SAFETENSORS_DTYPES:
            raise CheckpointError(f"{self.path}: tensor {key!r} has unsupported dtype {name}")
        return _SAFETENSORS_DTYPES[name]

    def read(self, key):
        try:
            return self._file.get_tensor(key)
        except Exception as exc:
            raise CheckpointError(f"{self.path}: cannot read tensor {key!r}: {exc}") from exc

    @property
    def metadata(self):
        return self._meta

    def close(self):
        self._file = None


# What a file named .safetensors holds when it is another format, by its first bytes.
_OTHER_FORMATS = (
    (b"PK\x03\x04", "a zip archive (the form torch.save writes), not safetensors: a PyTorch "
                     "checkpoint renamed .safetensors; give it its .pt/.pth name and it is read "
                     "with torch.load(weights_only=True)"),
    (b"GGUF", "a GGUF file, not safetensors: GGUF models are loaded by a GGUF loader node "
              "(ComfyUI-GGUF), not by this package"),
    (b"version https://git-lfs", "a Git LFS pointer (a small text file), not the model: fetch "
                                 "the real file with `git lfs pull`"),
)


def _head(path: Path, size: int) -> bytes | None:
    """The file's first `size` bytes, or None when it cannot be read."""
    try:
        with open(path, "rb") as handle:
            return handle.read(size)
    except OSError:
        return None


def _not_safetensors(path: Path, error: Exception) -> str:
    """Why the safetensors reader refused the file: what it holds instead, where its first
    bytes tell, else the reader's own message."""
    head = _head(path, 64)
    if head is None:
        return f"not a readable safetensors file: {error}"
    if not head:
        return "the file is empty (0 bytes): an interrupted download or copy?"
    for magic, what in _OTHER_FORMATS:
        if head.startswith(magic):
            return f"the file is {what}"
    if head[:1] == b"\x80" and head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05"):
        return ("the file is a Python pickle (an old-style PyTorch .pt/.ckpt/.bin checkpoint) "
                "renamed .safetensors, not safetensors; give it its .pt/.ckpt name and it is read "
                "with torch.load(weights_only=True)")
    if head.lstrip()[:1] == b"<":
        return ("the file is an HTML or XML page, not safetensors: a download that saved an "
                "error or login page instead of the model?")
    return f"not a readable safetensors file (truncated or corrupt?): {error}"


class ShardedSource(TensorSource):
    """A set of safetensors shards described by an index `{"weight_map": {key: shard}}`."""

    def __init__(self, index_path: Path):
        self.path = index_path
        try:
            index = json.loads(index_path.read_text())
            weight_map = index["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{index_path}: not a shard index with a 'weight_map' ({exc})") \
                from exc
        self._where: dict[str, SafetensorsSource] = {}
        shards: dict[str, SafetensorsSource] = {}
        for shard_name in sorted(set(weight_map.values())):
            shard_path = index_path.parent / shard_name
            if not shard_path.is_file():
                raise CheckpointError(f"{index_path}: shard {shard_name!r} listed in the index is "
                                      f"missing from {index_path.parent}")
            shards[shard_name] = SafetensorsSource(shard_path)
        for key, shard_name in weight_map.items():
            if key not in shards[shard_name].keys():
                raise CheckpointError(f"{index_path}: the index puts {key!r} in {shard_name}, "
                                      f"which does not hold it")
            self._where[key] = shards[shard_name]
        self._shards = shards

    def keys(self):
        return list(self._where)

    def shape(self, key):
        return self._where[key].shape(key)

    def dtype(self, key):
        return self._where[key].dtype(key)

    def read(self, key):
        return self._where[key].read(key)

    @property
    def metadata(self):
        return next(iter(self._shards.values())).metadata if self._shards else {}

    def metadata_sets(self):
        return [shard.metadata for shard in self._shards.values()]

    def close(self):
        for shard in self._shards.values():
            shard.close()


class TorchFileSource(TensorSource):
    """A pickled state dict, opened with weights_only=True (no arbitrary code runs)."""

    def __init__(self, path: Path):
        self.path = path
        try:
            # mapped where the file allows it (the zip form); the legacy pickle form is read
            mapped = _head(path, 4) == b"PK\x03\x04"
            state = torch.load(str(path), map_location="cpu", weights_only=True, mmap=mapped)
        except pickle.UnpicklingError as exc:
            raise CheckpointError(
                f"{path}: refused to load: the file needs arbitrary code to unpickle, which is "
                f"never run; only plain state dicts of tensors are accepted"
                f"{unpickling_reason(exc)}") from exc
        except (RuntimeError, OSError, EOFError, ValueError) as exc:
            raise CheckpointError(f"{path}: not a readable PyTorch checkpoint ({exc})") from exc
        for wrapper in ("state_dict", "model", "module"):
            if isinstance(state, dict) and isinstance(state.get(wrapper), dict) and len(state) <= 3:
                state = state[wrapper]
        if not isinstance(state, dict):
            raise CheckpointError(f"{path}: expected a state dict, found {type(state).__name__}")
        self._state = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
        if not self._state:
            raise CheckpointError(f"{path}: the file holds no tensors")

    def keys(self):
        return list(self._state)

    def shape(self, key):
        return tuple(self._state[key].shape)

    def dtype(self, key):
        return self._state[key].dtype

    def read(self, key):
        # a copy, so the loaded model does not stay backed by the file mapping
        return self._state[key].clone()

    def close(self):
        self._state = {}


_TERMINAL_CODES = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_GLOBAL = re.compile(r"GLOBAL ([\w.]+)")


def unpickling_reason(error: Exception) -> str:
    """What the file asked for, from torch's refusal: its terminal colour codes and its advice
    to load the file unsafely left out."""
    text = _TERMINAL_CODES.sub("", str(error))
    found = _GLOBAL.search(text)
    if found:
        return f" (it refers to {found.group(1)})"
    first = next((line.strip() for line in text.splitlines()
                  if line.strip() and "weights_only" not in line and "Weights only" not in line),
                 "")
    return f" ({first[:200]})" if first else ""


def _find_index(folder: Path) -> Path | None:
    indexes = sorted(folder.glob("*.safetensors.index.json"))
    return indexes[0] if len(indexes) == 1 else None


def open_checkpoint(path: str | Path) -> TensorSource:
    """Open any supported checkpoint form; errors name the path and what was expected."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path}: no such file or folder")
    if path.is_dir():
        index = _find_index(path)
        if index is not None:
            return ShardedSource(index)
        singles = sorted(path.glob("*.safetensors"))
        if len(singles) == 1:
            return SafetensorsSource(singles[0])
        raise CheckpointError(f"{path}: a folder needs one *.safetensors file or one "
                              f"*.safetensors.index.json shard index; found {len(singles)} "
                              f"safetensors files and no usable index")
    name = path.name
    if name.endswith(".index.json"):
        return ShardedSource(path)
    if name.endswith(".safetensors"):
        if "-of-" in name:  # one shard of a set: read the whole set through its index
            index = _find_index(path.parent)
            if index is not None:
                return ShardedSource(index)
        return SafetensorsSource(path)
    if path.suffix in (".pth", ".pt", ".bin", ".ckpt"):
        return TorchFileSource(path)
    raise CheckpointError(f"{path}: unknown checkpoint format; expected .safetensors, a shard "
                          f"index (.safetensors.index.json) or .pth/.pt/.bin")
