"""Prompts to CONDITIONING with the umT5 encoder.

The result has ComfyUI's form, [[rows [1, 512, 4096], {}]], with the rows past the prompt's
tokens set to zero: exactly what ComfyUI's own Wan text encoding produces, so our conditioning
feeds ComfyUI's samplers and theirs feeds ours; the DiT sees the same 512 rows the official
pipeline builds (valid rows, then zero rows).
"""

from __future__ import annotations

import torch

from .. import host
from .handles import WanTextEncoderHandle
from .placement import DevicePlacement


def encode_prompts(handle: WanTextEncoderHandle, prompts: list[str]) -> list[torch.Tensor]:
    """One float32 CPU tensor [1, 512, 4096] per prompt.

    On a GPU the encoder's blocks are streamed through it one at a time and the token lookup
    stays on the CPU (its table is 2 GB of the 11 GB encoder): the weights cross the bus once,
    as a whole-model placement would, but the device holds one block instead of the encoder.
    """
    device = host.compute_device() if handle.device == "gpu" else torch.device("cpu")
    model = handle.model
    ids, mask = handle.tokenizer(prompts)
    embedding_device = model.token_embedding.weight.device
    with DevicePlacement(device) as placement, torch.no_grad():
        placement.place(model.norm)
        blocks = _with_progress(placement.stream(model.blocks), len(model.blocks))
        hidden = model(ids.to(embedding_device), mask, device=device, blocks=blocks)
        rows = (hidden.float() * mask.to(device)[..., None]).to("cpu")
        del hidden
    return [rows[i:i + 1] for i in range(rows.shape[0])]


def _with_progress(blocks, total: int, label: str = "Wan Text Encode"):
    """The blocks, with a progress update (and, inside ComfyUI, an interrupt check) after each:
    a CPU encode of the full umT5 takes minutes."""
    progress = host.Progress(total, label)
    for index, block in enumerate(blocks, 1):
        yield block
        progress.update_to(index)


def as_conditioning(rows: torch.Tensor) -> list:
    return [[rows, {}]]
