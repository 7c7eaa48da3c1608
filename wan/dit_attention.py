"""The DiT block's two attentions (self-attention over all tokens with RoPE, cross-attention to
the text and, for Wan2.1 I2V, the CLIP image tokens) and their q/k RMS norm over the whole model
width. Parameter names equal the official checkpoint keys."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .fp8_attention import fp8_attention, fp8_attention_normed_query
from .glue import rms_norm_heads
from .rope import RotaryTable


class RMSNorm(nn.Module):
    """RMS norm over the whole model width (all heads at once), computed in float32."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return (normed * self.weight.float()).to(x.dtype)


class Projections(nn.Module):
    """What both attentions hold: the q, k, v and o projections and the q/k norms (the
    official checkpoint's names)."""

    def __init__(self, dim: int, num_heads: int, eps: float):
        super().__init__()
        self.num_heads = num_heads
        self.q = nn.Linear(dim, dim)
        self.k = nn.Linear(dim, dim)
        self.v = nn.Linear(dim, dim)
        self.o = nn.Linear(dim, dim)
        self.norm_q = RMSNorm(dim, eps)
        self.norm_k = RMSNorm(dim, eps)

    def _heads(self, t: torch.Tensor) -> torch.Tensor:
        return t.view(t.shape[0], t.shape[1], self.num_heads, -1)


class SelfAttention(Projections):
    """Every query attends to every key: the keys and values of all rows are made first, then the
    queries row chunk by row chunk (WanBlock runs the phases)."""

    def _rotated(self, t: torch.Tensor, norm: RMSNorm, rope: RotaryTable, start: int):
        return rms_norm_heads(t, norm.weight, norm.eps, self.num_heads, rope, start)

    def keys_values(self, h: torch.Tensor, rope: RotaryTable, start: int):
        """Rotated keys and the values of rows start.. (h: their normed input)."""
        return self._rotated(self.k(h), self.norm_k, rope, start), self._heads(self.v(h))

    def attend_rows(self, h: torch.Tensor, rope: RotaryTable, start: int, k, v,
                    attend, keys=None) -> torch.Tensor:
        """The attention output of rows start.. (h: their normed input) over all keys. The fp8
        backend takes the queries before their norm: it norms, rotates and quantizes them in
        one pass; `keys`: k and v as it quantized them once for all chunks (fp8_keys)."""
        q = self.q(h)
        if attend is fp8_attention:
            out = fp8_attention_normed_query(q, self.norm_q.weight, self.norm_q.eps,
                                             self.num_heads, rope, start, k, v, keys)
        else:
            out = attend(self._rotated(q, self.norm_q, rope, start), k, v)
        return after_opaque(self.o, out.flatten(2))


class CrossAttention(Projections):
    """Attention from video tokens to the text rows (all rows, no mask) and, for Wan2.1 I2V,
    separately to the CLIP image tokens; the two results are summed before the output projection."""

    def __init__(self, dim: int, num_heads: int, eps: float, image_branch: bool):
        super().__init__(dim, num_heads, eps)
        if image_branch:
            self.k_img = nn.Linear(dim, dim)
            self.v_img = nn.Linear(dim, dim)
            self.norm_k_img = RMSNorm(dim, eps)

    def _normed(self, t: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
        return rms_norm_heads(t, norm.weight, norm.eps, self.num_heads)

    def keys_values(self, context, image_context):
        """Keys and values of the text rows (and image tokens), made once per block."""
        text = (self._normed(self.k(context), self.norm_k), self._heads(self.v(context)))
        if image_context is None:
            return text, None
        image = (self._normed(self.k_img(image_context), self.norm_k_img),
                 self._heads(self.v_img(image_context)))
        return text, image

    def attend_rows(self, h: torch.Tensor, text_kv, image_kv, attend) -> torch.Tensor:
        q = self._normed(self.q(h), self.norm_q)
        out = attend(q, *text_kv)
        if image_kv is None:
            return after_opaque(self.o, out.flatten(2))
        # the sum of the two attentions is a step a compiled graph fuses the codes into
        return self.o((out + attend(q, *image_kv)).flatten(2))


def after_opaque(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """layer(x) for an x that an attention kernel made: a layer that quantizes its input (fp8
    matmuls) then does so in a kernel of its own inside compiled graphs too, since there is no
    step before it that the compiler could fuse the quantization into
    (Fp8Linear.forward_after_opaque)."""
    forward = getattr(layer, "forward_after_opaque", None)
    return layer(x) if forward is None else forward(x)
