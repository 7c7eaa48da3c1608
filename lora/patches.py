"""What a LoRA file changes in one parameter, and that change as arithmetic.

A patch names the file keys it reads (the tensors are read when used) and the numbers its
header gave. The arithmetic is ComfyUI's weight adapters' (comfy/weight_adapter/), in float32:

  LowRank     delta = scale * up @ down                       scale = alpha / rank, else 1
  Difference  delta = scale * tensor                          scale 1; PEFT's lora_B.bias: its
                                                              pair's scale
  Hadamard    delta = scale * (w1_a @ w1_b) * (w2_a @ w2_b)   LoHa; scale = alpha / rank of w1
              (Tucker: each factor t ×1 w_a ×2 w_b)
  Kronecker   delta = scale * kron(w1, w2)                    LoKr; w1, w2 whole or products of
              (w2 Tucker: t2 ×1 w2_a ×2 w2_b)                 two factors; scale = alpha / rank
                                                              of the decomposed factor (w2's
                                                              first), else 1
  Decomposed  DoRA: not a sum; it rescales the weight its inner patch has changed (apply_dora_)
  Orthogonal  OFT: not a sum; the weight's output rows, in blocks, turned by the Cayley
              transform R of the skew-symmetric part of each block (apply_oft_)
  Butterfly   BOFT: not a sum; the rows turned by a product of m butterfly-arranged block
              rotations (apply_boft_)
  Generalized GLoRA: delta = scale * (W a1 a2 + b1 b2) (its newer layout; the older one
              W a2 a1 + b2 b1), a function of the weight W
  Replacement the weight set to the tensor, the strength not applying (ComfyUI's "set")

Every delta except DoRA's and OFT's is added as weight += strength * delta; DoRA at strength s
moves the weight s of the way to its result: W + s * (W_dora - W); OFT at strength s adds
s * (s * (R - I))^T applied to each block of rows, as ComfyUI does (so strength enters twice).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

Read = Callable[[str], torch.Tensor]


@dataclass(frozen=True)
class LowRank:
    """delta = scale * up @ down (flattened to the weight's shape)."""
    up: str  # file keys
    down: str
    rank: int
    scale: float  # alpha / rank, or 1 without an alpha


@dataclass(frozen=True)
class Difference:
    """delta = scale * the tensor itself (a weight, parameter or bias difference)."""
    key: str
    scale: float = 1.0


@dataclass(frozen=True)
class Hadamard:
    """LoHa: the elementwise product of two low-rank products."""
    w1_a: str
    w1_b: str
    w2_a: str
    w2_b: str
    t1: str | None
    t2: str | None
    rank: int
    scale: float


@dataclass(frozen=True)
class Kronecker:
    """LoKr: the Kronecker product of a small factor w1 and a larger w2; each either whole or
    the product of two factors (w2 also with a Tucker core t2)."""
    w1: str | None
    w1_a: str | None
    w1_b: str | None
    w2: str | None
    w2_a: str | None
    w2_b: str | None
    t2: str | None
    rank: int | None  # of the decomposed factor that sets the scale, None when both are whole
    scale: float


Additive = LowRank | Hadamard | Kronecker


@dataclass(frozen=True)
class Decomposed:
    """DoRA: an additive patch whose result is rescaled per row or per column to `magnitude`.

    norm "comfyui": a kohya / LyCORIS `dora_scale`, computed as ComfyUI does: when it has one
      entry per output row, the rows' norms are the weight's before the change; otherwise
      (one per input column) the columns' norms of the changed weight, each plus float32's eps.
    norm "peft": PEFT's `lora_magnitude_vector` (one entry per output row) over the rows' norms
      of the changed weight, as PEFT merges it.
    """
    inner: Additive
    magnitude: str
    norm: str  # "comfyui" | "peft"

    @property
    def scale(self) -> float:
        return self.inner.scale


@dataclass(frozen=True)
class Replacement:
    """The weight replaced by the tensor, whatever the strength (ComfyUI's "set" patch)."""
    key: str

    @property
    def scale(self) -> float:
        return 1.0


@dataclass(frozen=True)
class Orthogonal:
    """OFT: `blocks` [k, n, n], one n x n matrix per block of n output rows (k * n rows);
    `constraint` (the file's alpha, 0 without one): the skew-symmetric part is scaled down to
    this Frobenius norm when larger."""
    blocks: str
    constraint: float

    @property
    def scale(self) -> float:
        return 1.0


@dataclass(frozen=True)
class Butterfly:
    """BOFT: `blocks` [m, k, n, n], m butterfly levels of k rotations of n rows each;
    `constraint` as OFT's; `rescale` [rows, 1, ...] or None."""
    blocks: str
    constraint: float
    rescale: str | None

    @property
    def scale(self) -> float:
        return 1.0


@dataclass(frozen=True)
class Generalized:
    """GLoRA: a1, a2, b1, b2 as the file names them; `old_layout`: LyCORIS's first (W a2 a1 +
    b2 b1), decided from the shapes as ComfyUI decides it; scale = alpha / rank, else 1."""
    a1: str
    a2: str
    b1: str
    b2: str
    old_layout: bool
    rank: int
    scale: float


Patch = (LowRank | Difference | Hadamard | Kronecker | Decomposed | Orthogonal | Replacement
         | Butterfly | Generalized)
# patches that change a weight by a function of it rather than by a term added to it
NOT_ADDITIVE = (Decomposed, Orthogonal, Replacement, Butterfly, Generalized)


def file_keys(patch: Patch) -> list[str]:
    """The file keys a patch reads, in the order the file names them."""
    if isinstance(patch, Decomposed):
        return [*file_keys(patch.inner), patch.magnitude]
    if isinstance(patch, Orthogonal):
        return [patch.blocks]
    if isinstance(patch, Butterfly):
        return [patch.blocks] + ([patch.rescale] if patch.rescale else [])
    if isinstance(patch, Generalized):
        return [patch.a1, patch.a2, patch.b1, patch.b2]
    names = {LowRank: ("up", "down"), Difference: ("key",), Replacement: ("key",),
             Hadamard: ("w1_a", "w1_b", "w2_a", "w2_b", "t1", "t2"),
             Kronecker: ("w1", "w1_a", "w1_b", "w2", "w2_a", "w2_b", "t2")}[type(patch)]
    return [key for key in (getattr(patch, n) for n in names) if key is not None]


def _f32(read: Read, key: str, device) -> torch.Tensor:
    return read(key).to(device=device, dtype=torch.float32)


def _tucker(core: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """A Tucker-decomposed factor: core [r1, r2, *k] with a [r1, out] and b [r2, in] ->
    [out, in, *k]."""
    return torch.einsum("i j ..., j r, i p -> p r ...", core, b, a)


def unscaled_delta(patch: Additive, read: Read, shape: tuple[int, ...], device=None
                   ) -> torch.Tensor:
    """The patch's product (before its scale) as a float32 tensor of the weight's `shape`."""
    if isinstance(patch, LowRank):
        up = _f32(read, patch.up, device).flatten(1)
        return (up @ _f32(read, patch.down, device).flatten(1)).reshape(shape)
    if isinstance(patch, Hadamard):
        return (_hadamard_factor(read, patch.w1_a, patch.w1_b, patch.t1, device)
                * _hadamard_factor(read, patch.w2_a, patch.w2_b, patch.t2, device)
                ).reshape(shape)
    return _kronecker(patch, read, shape, device)


def _hadamard_factor(read: Read, a: str, b: str, core: str | None, device) -> torch.Tensor:
    if core is not None:
        return _tucker(_f32(read, core, device), _f32(read, a, device), _f32(read, b, device))
    return _f32(read, a, device).flatten(1) @ _f32(read, b, device).flatten(1)


def _kronecker(patch: Kronecker, read: Read, shape: tuple[int, ...], device) -> torch.Tensor:
    w1 = (_f32(read, patch.w1, device) if patch.w1 is not None else
          _f32(read, patch.w1_a, device) @ _f32(read, patch.w1_b, device))
    if patch.w2 is not None:
        w2 = _f32(read, patch.w2, device)
    elif patch.t2 is not None:
        w2 = _tucker(_f32(read, patch.t2, device), _f32(read, patch.w2_a, device),
                     _f32(read, patch.w2_b, device))
    else:
        w2 = _f32(read, patch.w2_a, device) @ _f32(read, patch.w2_b, device).flatten(1)
    w1 = w1.reshape(w1.shape[0], -1)
    rows, cols = shape[0] // w1.shape[0], shape[1] // w1.shape[1]
    # a convolution's kernel rides on w2; w1 is one number per (row block, column block)
    w2 = w2.reshape(rows, cols, *shape[2:])
    return torch.kron(w1.reshape(*w1.shape, *[1] * (len(shape) - 2)), w2)


def add_(weight: torch.Tensor, patch: Patch, read: Read, strength: float) -> None:
    """weight (float32, on any device) changed in place by `patch` at `strength`."""
    where = dict(device=weight.device, dtype=torch.float32)
    if isinstance(patch, Decomposed):
        apply_dora_(weight, patch, read, strength)
    elif isinstance(patch, Orthogonal):
        apply_oft_(weight, patch, read, strength)
    elif isinstance(patch, Replacement):
        weight.copy_(read(patch.key).to(**where).reshape(weight.shape))
    elif isinstance(patch, Butterfly):
        apply_boft_(weight, patch, read, strength)
    elif isinstance(patch, Generalized):
        weight.add_(glora_delta(weight, patch, read), alpha=strength * patch.scale)
    elif isinstance(patch, LowRank):
        up = read(patch.up).to(**where).flatten(1)
        down = read(patch.down).to(**where).flatten(1)
        weight.view(weight.shape[0], -1).addmm_(up, down, alpha=strength * patch.scale)
    elif isinstance(patch, Difference):
        weight.add_(read(patch.key).to(**where).reshape(weight.shape),
                    alpha=strength * patch.scale)
    else:
        weight.add_(unscaled_delta(patch, read, tuple(weight.shape), weight.device),
                    alpha=strength * patch.scale)


def apply_dora_(weight: torch.Tensor, patch: Decomposed, read: Read, strength: float) -> None:
    """weight (float32) moved `strength` of the way to its DoRA result."""
    shape = tuple(weight.shape)
    changed = weight + patch.scale * unscaled_delta(patch.inner, read, shape, weight.device)
    magnitude = _f32(read, patch.magnitude, weight.device)
    rows = weight.shape[0]
    if patch.norm == "peft":
        norm = changed.reshape(rows, -1).norm(dim=1).reshape(rows, *[1] * (weight.dim() - 1))
        magnitude = magnitude.reshape(norm.shape)
    elif magnitude.shape[0] == rows:
        norm = weight.reshape(rows, -1).norm(dim=1, keepdim=True)
        norm = norm.reshape(rows, *[1] * (weight.dim() - 1)) + torch.finfo(torch.float32).eps
        magnitude = magnitude.reshape(norm.shape)
    else:
        cols = weight.shape[1]
        norm = changed.transpose(0, 1).reshape(cols, -1).norm(dim=1, keepdim=True)
        norm = norm.reshape(cols, *[1] * (weight.dim() - 1)).transpose(0, 1)
        norm = norm + torch.finfo(torch.float32).eps
        magnitude = magnitude.reshape(norm.shape)
    changed.mul_(magnitude / norm)
    if strength == 1.0:
        weight.copy_(changed)
    else:
        weight.add_(changed.sub_(weight), alpha=strength)


def apply_oft_(weight: torch.Tensor, patch: Orthogonal, read: Read, strength: float) -> None:
    """weight (float32) += strength * (strength * (R - I))^T applied per block of rows, R the
    Cayley transform (I + Q)(I - Q)^-1 of Q = B - B^T, Q scaled to the constraint's norm."""
    blocks = _f32(read, patch.blocks, weight.device)
    count, size, _ = blocks.shape
    rotation = _cayley(blocks, patch.constraint)
    eye = torch.eye(size, device=weight.device, dtype=torch.float32)
    turned = torch.einsum("k n m, k n ... -> k m ...", strength * rotation - strength * eye,
                          weight.view(count, size, *weight.shape[1:]))
    weight.add_(turned.reshape(weight.shape), alpha=strength)


def _cayley(blocks: torch.Tensor, constraint: float) -> torch.Tensor:
    """(I + Q)(I - Q)^-1 of Q = B - B^T over the last two dimensions, Q scaled down to the
    constraint's Frobenius norm (over all blocks) when larger (OFT's and BOFT's rotations)."""
    size = blocks.shape[-1]
    skew = blocks - blocks.transpose(-1, -2)
    if constraint > 0:
        norm = skew.norm() + 1e-8
        if norm > constraint:
            skew = skew * (constraint / norm)
    eye = torch.eye(size, device=blocks.device, dtype=torch.float32)
    return (eye + skew) @ torch.linalg.inv(eye - skew)


def apply_boft_(weight: torch.Tensor, patch: Butterfly, read: Read, strength: float) -> None:
    """weight (float32) += strength * (B(W) - W): B the butterfly product of the levels'
    rotations (each moved toward the identity by the strength when it is not 1), then the
    rescale, as ComfyUI computes it (so strength enters twice)."""
    blocks = _f32(read, patch.blocks, weight.device)
    levels, _, size, _ = blocks.shape
    rotations = _cayley(blocks, patch.constraint)
    eye = torch.eye(size, device=weight.device, dtype=torch.float32)
    turned, half = weight, size // 2
    for level in range(levels):
        rotation = rotations[level]
        if strength != 1:
            rotation = rotation * strength + (1 - strength) * eye
        span = 2 ** level * half
        turned = (turned.unflatten(0, (-1, 2, span)).transpose(1, 2).flatten(0, 2)
                  .unflatten(0, (-1, size)))
        turned = torch.einsum("b i j, b j ... -> b i ...", rotation, turned)
        turned = turned.flatten(0, 1).unflatten(0, (-1, span, 2)).transpose(1, 2).flatten(0, 2)
    if patch.rescale is not None:
        turned = turned * _f32(read, patch.rescale, weight.device)
    weight.add_(turned - weight, alpha=strength)


def glora_delta(weight: torch.Tensor, patch: Generalized, read: Read) -> torch.Tensor:
    a1, a2, b1, b2 = (_f32(read, k, weight.device).flatten(1)
                      for k in (patch.a1, patch.a2, patch.b1, patch.b2))
    if patch.old_layout:
        return (b2 @ b1 + (weight.flatten(1) @ a2) @ a1).reshape(weight.shape)
    if weight.dim() > 2:
        turned = torch.einsum("o i ..., i j -> o j ...",
                              torch.einsum("o i ..., i j -> o j ...", weight, a1), a2)
    else:
        turned = (weight @ a1) @ a2
    return turned.reshape(weight.shape) + (b1 @ b2).reshape(weight.shape)
