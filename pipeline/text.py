"""Prompts to CONDITIONING with the umT5 encoder.

The result has ComfyUI's form, [[rows [1, 512, 4096], {}]], with the rows past the prompt's
tokens set to zero: exactly what ComfyUI's own Wan text encoding produces, so our conditioning
feeds ComfyUI's samplers and theirs feeds ours; the DiT sees the same 512 rows the official
pipeline builds (valid rows, then zero rows).

A prompt encoded once is not encoded again while its encoder is loaded: the rows are kept per
loaded encoder (the module object, so another file, dtype or load is another cache), keyed by the
prompt's token ids and where the encoder runs, for the last CACHED_PROMPTS prompts. Each prompt
is encoded alone (a batch of one), so a row is the same whether it was cached or not and
whatever was encoded beside it.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict

import torch

from .. import host
from .handles import WanTextEncoderHandle
from .placement import DevicePlacement

CACHED_PROMPTS = 16  # per loaded encoder: 8 MiB of float32 rows each

_CACHE: "weakref.WeakKeyDictionary[torch.nn.Module, OrderedDict]" = weakref.WeakKeyDictionary()


def encode_prompts(handle: WanTextEncoderHandle, prompts: list[str]) -> list[torch.Tensor]:
    """One float32 CPU tensor [1, 512, 4096] per prompt (a tensor of its own: the caller may
    change it)."""
    ids, mask = handle.tokenizer(prompts)
    cache = _CACHE.setdefault(handle.model, OrderedDict())
    keys = [(handle.device, ids[i].numpy().tobytes(), mask[i].numpy().tobytes())
            for i in range(len(prompts))]
    missing = list(dict.fromkeys(k for k in keys if k not in cache))
    if missing:
        rows = _encode(handle, ids, mask, [keys.index(k) for k in missing])
        for key, row in zip(missing, rows):
            cache[key] = row
    for key in keys:
        cache.move_to_end(key)
    out = [cache[key].clone() for key in keys]
    while len(cache) > CACHED_PROMPTS:
        cache.popitem(last=False)
    return out


def cached_prompts(handle: WanTextEncoderHandle) -> int:
    """How many prompts' rows are kept for this handle's encoder."""
    return len(_CACHE.get(handle.model, ()))


def _encode(handle: WanTextEncoderHandle, ids: torch.Tensor, mask: torch.Tensor,
            rows: list[int]) -> list[torch.Tensor]:
    """The rows `rows` of (ids, mask), each encoded alone, in one pass over the encoder.

    On a GPU the encoder's blocks are streamed through it one at a time and the token lookup
    stays on the CPU (its table is 2 GB of the 11 GB encoder): the weights cross the bus once,
    as a whole-model placement would, but the device holds one block instead of the encoder.
    """
    device = host.compute_device() if handle.device == "gpu" else torch.device("cpu")
    model = handle.model
    embedding_device = model.token_embedding.weight.device
    ids, mask = ids[rows], mask[rows]
    with DevicePlacement(device) as placement, torch.no_grad():
        placement.place(model.norm)
        blocks = _with_progress(placement.stream(model.blocks), len(model.blocks))
        hidden = model.forward_each(ids.to(embedding_device), mask, device=device,
                                    blocks=blocks)
        out = [(h.float() * m.to(device)[None, :, None]).to("cpu") for h, m in zip(hidden, mask)]
        del hidden
    return out


def _with_progress(blocks, total: int, label: str = "Wan Text Encode"):
    """The blocks, with a progress update and an interrupt check (ComfyUI's, or the command
    line's Ctrl-C / SIGTERM) before each: a CPU encode of the full umT5 takes minutes."""
    progress = host.Progress(total, label)
    for index, block in enumerate(blocks, 1):
        host.check_interrupt()
        yield block
        progress.update_to(index)


def as_conditioning(rows: torch.Tensor) -> list:
    return [[rows, {}]]
