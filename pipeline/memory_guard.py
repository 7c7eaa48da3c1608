"""The memory a video needs, estimated before anything is allocated, and a refusal that says
how much is needed, how much there is and the largest size that fits.

Without it an oversized video (8192x8192x1025) passed validation and the process grew until the
out-of-memory killer ended it, or died with the allocator's raw message. The estimates count the
tensors a run certainly holds at once, so a refusal is never wrong about a size that would fit;
what a run needs besides them (allocator rounding, small temporaries) is not counted:

- the decoded video: the IMAGE frames every decoder returns, float32 [B*F, H, W, 3], in CPU memory;
- the latent: float32 [B, C, 1 + (F-1)/4, H/s, W/s] (C, s: 16 and 8 for the Wan2.1 VAE, 48 and
  16 for the Wan2.2 VAE);
- sampling, on the compute device: four latent-sized float32 tensors (the sample, the
  conditional and unconditional velocities, the solver's last output) and one DiT forward's
  activations: the float32 residual stream of every token and the self-attention keys and values
  in the compute dtype (tokens = latent frames x latent height/2 x latent width/2);
- the weights the sampler or decoder still has to place on a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

import torch

from ..wan.configs import TEMPORAL_STRIDE, VAES
from .errors import InputError

GIB = 1 << 30
SAMPLING_LATENT_COPIES = 4
# (latent channels, pixels per latent pixel) of the Wan VAEs
VAE_LATENTS = {kind: (spec.latent_channels, spec.spatial_stride) for kind, spec in VAES.items()}


class MemoryRefusal(InputError):
    """A size whose estimated memory exceeds what there is; the message gives both and the
    largest size that fits."""


@dataclass(frozen=True)
class VideoSize:
    width: int
    height: int
    frames: int
    batch: int = 1

    @property
    def latent_frames(self) -> int:
        return (self.frames - 1) // TEMPORAL_STRIDE + 1

    def __str__(self) -> str:
        text = f"{self.width}x{self.height}x{self.frames}"
        return text if self.batch == 1 else f"{text} (batch {self.batch})"


# -- what there is -----------------------------------------------------------------------------

def free_bytes(device: torch.device | str) -> int:
    """Memory a new allocation can take now: on a GPU what the driver has free plus what torch
    holds unused in its cache, within this process's cap if one is set
    (torch.cuda.set_per_process_memory_fraction: the allocator refuses past it); on the CPU what
    the system reports available."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        allocated = torch.cuda.memory_allocated(device)
        available = free + torch.cuda.memory_reserved(device) - allocated
        cap = process_cap_bytes(device)
        if cap is not None:
            available = min(available, cap - allocated)
        return max(0, int(available))
    import psutil
    return int(psutil.virtual_memory().available)


def total_bytes(device: torch.device | str) -> int:
    """What the device holds: on a GPU its memory, or this process's cap if one is set."""
    device = torch.device(device)
    if device.type == "cuda":
        cap = process_cap_bytes(device)
        return cap if cap is not None else \
            int(torch.cuda.get_device_properties(device).total_memory)
    import psutil
    return int(psutil.virtual_memory().total)


def process_cap_bytes(device: torch.device) -> int | None:
    """The most this process may allocate on CUDA `device` when a memory fraction below 1 is set
    for it (torch.cuda.set_per_process_memory_fraction), else None."""
    fraction = torch.cuda.get_per_process_memory_fraction(device)
    if fraction >= 1.0:
        return None
    return int(fraction * torch.cuda.get_device_properties(device).total_memory)


def describe_device(device: torch.device | str) -> str:
    device = torch.device(device)
    return "the CPU (system memory)" if device.type == "cpu" else f"{device}"


# -- estimates ---------------------------------------------------------------------------------

def frames_bytes(size: VideoSize) -> int:
    """The decoded video as IMAGE frames, float32 RGB."""
    return size.batch * size.frames * size.height * size.width * 3 * 4


def latent_bytes(size: VideoSize, vae: str) -> int:
    channels, stride = VAE_LATENTS[vae]
    return (size.batch * channels * size.latent_frames * (size.height // stride)
            * (size.width // stride) * 4)


def smallest_latent_bytes(size: VideoSize) -> int:
    """The latent of any Wan VAE (the model is not known yet)."""
    return min(latent_bytes(size, vae) for vae in VAE_LATENTS)


def _tokens(config, vae: str, size: VideoSize) -> int:
    _, stride = VAE_LATENTS[vae]
    _, patch_h, patch_w = config.patch_size
    return (size.latent_frames * (size.height // stride // patch_h)
            * (size.width // stride // patch_w))


def sampling_bytes(config, vae: str, size: VideoSize, compute_itemsize: int = 2) -> int:
    """Latent copies and one DiT forward's activations, on the compute device (see above)."""
    activations = size.batch * _tokens(config, vae, size) * config.dim * (4 + 2 * compute_itemsize)
    return SAMPLING_LATENT_COPIES * latent_bytes(size, vae) + activations


def block_cache_bytes(config, vae: str, size: VideoSize, branches: int) -> int:
    """TeaCache / MagCache (sampling/residual_cache.py): the block stack's float32 residual kept
    per guidance branch, and the one a full forward holds while it makes the next."""
    return (branches + 1) * size.batch * _tokens(config, vae, size) * config.dim * 4


# -- refusing ----------------------------------------------------------------------------------

def gib(count: int) -> str:
    if count >= GIB // 10:
        return f"{count / GIB:.1f} GiB"
    return f"{count / (1 << 20):.0f} MiB" if count >= 1 << 20 else f"{count / 1024:.0f} KiB"


def largest_fitting(size: VideoSize, stride: int, needed: Callable[[VideoSize], int],
                    available: int) -> str:
    """The longest video of this frame size, and the largest frame (same shape) of this length,
    whose `needed` bytes fit `available`."""
    options = []
    steps = (size.frames - 1) // TEMPORAL_STRIDE
    low, high = -1, steps  # the largest n with 4n+1 frames fitting, -1 when none
    while low < high:
        middle = (low + high + 1) // 2
        if needed(replace(size, frames=TEMPORAL_STRIDE * middle + 1)) <= available:
            low = middle
        else:
            high = middle - 1
    if low >= 0:
        options.append(f"{size.width}x{size.height} with up to {TEMPORAL_STRIDE * low + 1} "
                       f"frames")
    smaller = _largest_frame(size, stride, needed, available)
    if smaller is not None:
        options.append(f"{smaller.width}x{smaller.height} with {size.frames} frames")
    return " or ".join(options) if options else "none at this batch size"


def _largest_frame(size: VideoSize, stride: int, needed, available) -> VideoSize | None:
    def scaled(factor: float) -> VideoSize:
        return replace(size, width=max(stride, int(size.width * factor) // stride * stride),
                       height=max(stride, int(size.height * factor) // stride * stride))

    if needed(scaled(0.0)) > available:
        return None
    low, high = 0.0, 1.0
    for _ in range(40):
        middle = (low + high) / 2
        low, high = (middle, high) if needed(scaled(middle)) <= available else (low, middle)
    return scaled(low)


def check_fits(what: str, size: VideoSize, stride: int, needed: Callable[[VideoSize], int],
               available: int, have: str) -> None:
    """Raise MemoryRefusal when `needed(size)` exceeds `available` bytes; `have` says what the
    available bytes are ("{available}" is replaced by their amount)."""
    count = needed(size)
    if count <= available:
        return
    raise MemoryRefusal(f"{size}: {what} needs at least {gib(count)}; "
                        f"{have.replace('{available}', gib(available))}; the largest that fits: "
                        f"{largest_fitting(size, stride, needed, available)}")


def refusal_or_none(what: str, size: VideoSize, stride: int, needed, available: int,
                    have: str) -> str | None:
    try:
        check_fits(what, size, stride, needed, available, have)
    except MemoryRefusal as refusal:
        return str(refusal)
    return None


def machine_memory() -> tuple[int, str]:
    """(bytes, description) of this machine's memory for a check made before a run: all of
    it (what is free then changes as models load and ComfyUI frees its caches)."""
    total = total_bytes("cpu")
    return total, f"this machine has {{available}} of memory in all ({gib(free_bytes('cpu'))} " \
                  f"free now)"


def free_memory(device: torch.device | str) -> tuple[int, str]:
    free = free_bytes(device)
    return free, f"{describe_device(device)} has {{available}} free"


# -- the checks the stages make before they allocate -------------------------------------------

def size_of_latent(shape, vae: str) -> VideoSize:
    """The video a latent [B, C, T, h, w] decodes to."""
    batch, _, frames, height, width = shape
    _, stride = VAE_LATENTS[vae]
    return VideoSize(width * stride, height * stride, TEMPORAL_STRIDE * (frames - 1) + 1, batch)


def check_latent(size: VideoSize, vae: str, stride: int) -> None:
    """The zero latent of a new video, in CPU memory."""
    available, have = free_memory("cpu")
    check_fits("the latent", size, stride, lambda s: latent_bytes(s, vae), available, have)


def check_sampling(handle, latent_shape, device: torch.device, block_swap: int = 0,
                   prefetch_blocks: int = 1, cache_branches: int = 0) -> None:
    """Sampling `handle`'s model over a latent of `latent_shape` on `device`: the latent copies,
    one forward's activations, the residuals of a block-skipping step cache over
    `cache_branches` guidance branches (0: none) and, on a GPU, the weights still to be placed
    there."""
    from .. import host

    device = torch.device(device)
    size = size_of_latent(latent_shape, handle.vae_kind)
    weights = _weights_to_place(handle.model, device, block_swap, prefetch_blocks)

    def needed(s: VideoSize) -> int:
        return _activation_bytes(handle, s, cache_branches) + weights

    if device.type == "cuda":
        host.make_room(needed(size), device)  # the host's own models make way first
    available, have = free_memory(device)
    what = (f"sampling {handle.name} (latent copies, one forward's activations"
            f"{', the step cache residuals' if cache_branches else ''}"
            f"{' and the weights to place' if weights else ''})")
    check_fits(what, size, handle.spatial_stride, needed, available, have)


def fitting_block_swap(handle, latent_shape, device: torch.device,
                       prefetch_blocks: int = 1, cache_branches: int = 0) -> int:
    """The fewest DiT blocks to stream from CPU memory (block swap) for sampling `handle`'s
    model over `latent_shape` to fit what `device` has free once the host has made room for
    the whole model: 0 when it fits resident (and on a CPU); every block when nothing less fits
    (check_sampling then refuses, with the largest size that fits)."""
    from .. import host

    device = torch.device(device)
    if device.type != "cuda":
        return 0
    blocks = len(getattr(handle.model, "blocks", []))
    activations = _activation_bytes(handle, size_of_latent(latent_shape, handle.vae_kind),
                                    cache_branches)

    def needed(swapped: int) -> int:
        return activations + _weights_to_place(handle.model, device, swapped, prefetch_blocks)

    host.make_room(needed(0), device)
    available, _ = free_memory(device)
    return next((n for n in range(blocks + 1) if needed(n) <= available), blocks)


def _activation_bytes(handle, size: VideoSize, cache_branches: int = 0) -> int:
    """The latent copies and one forward's activations of `handle`'s model in its compute
    dtype (sampling_bytes), and a block-skipping step cache's residuals (block_cache_bytes)."""
    itemsize = getattr(handle.model, "compute_dtype", torch.bfloat16).itemsize
    cached = block_cache_bytes(handle.config, handle.vae_kind, size, cache_branches) \
        if cache_branches else 0
    return sampling_bytes(handle.config, handle.vae_kind, size, itemsize) + cached


def _weights_to_place(model, device, block_swap, prefetch_blocks) -> int:
    from .placement import tensor_bytes

    if device.type != "cuda":
        return 0  # on the CPU the weights are in memory already
    first = next(model.parameters(), None)
    if first is None or first.device.type == "cuda":
        return 0
    blocks = list(getattr(model, "blocks", []))
    swapped = min(block_swap, len(blocks))
    block = tensor_bytes(blocks[0]) if blocks else 0
    return tensor_bytes(model) - swapped * block + min(prefetch_blocks + 1, swapped) * block


def check_decoded_frames(size: VideoSize, stride: int) -> None:
    """The decoded video, float32 frames in CPU memory."""
    available, have = free_memory("cpu")
    check_fits("the decoded video (float32 frames in CPU memory)", size, stride, frames_bytes,
               available, have)


def check_untiled_decode(cost, size: VideoSize, vae_stride: int, device: torch.device) -> None:
    """A whole-frame decode on a GPU (`cost`: vae_tiling.budget.DecodeCost)."""
    if torch.device(device).type != "cuda":
        return
    available, have = free_memory(device)
    try:
        check_fits("an untiled decode", size, vae_stride,
                   lambda s: cost.bytes(s.height // vae_stride, s.width // vae_stride),
                   available, have)
    except MemoryRefusal as refusal:
        raise MemoryRefusal(f"{refusal}; or mode auto, which tiles the frame to fit") from None
