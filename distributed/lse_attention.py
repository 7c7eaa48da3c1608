"""Attention that also returns the log-sum-exp of each query's scores: what ring attention needs
to merge the partial results over blocks of keys exactly (online softmax).

Layout as everywhere in the DiT: q [B, Lq, H, D], k and v [B, Lk, H, D]. Returns the output in
float32 [B, Lq, H, D] and the log-sum-exp in float32 [B, Lq, H]. Fused kernels where PyTorch has
one that returns it (the CPU flash kernel; the memory-efficient kernel on CUDA), the plain
formula in query chunks elsewhere or when a kernel refuses the shapes.
"""

from __future__ import annotations

import math

import torch

# query rows per chunk of the plain formula: its scores are chunk x Lk x heads float32
_SCORE_BYTES = 1 << 28


def attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, L, D]
    fused = _fused(qt, kt, vt)
    if fused is None:
        out, lse = _plain(qt, kt, vt)
    else:
        out, lse = fused
    return out.transpose(1, 2).float(), lse[..., :q.shape[1]].transpose(1, 2).float()


def _fused(q, k, v):
    try:
        if q.device.type == "cpu":
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v)
            return out, lse
        if q.device.type == "cuda":
            out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(
                q, k, v, None, True)[:2]
            return out, lse
    except (RuntimeError, NotImplementedError, AttributeError):
        return None
    return None


def _plain(q, k, v):
    """softmax(q k^T / sqrt(D)) v and the log-sum-exp, float32, over chunks of query rows."""
    b, h, lq, d = q.shape
    scale = 1.0 / math.sqrt(d)
    rows = max(1, _SCORE_BYTES // max(1, b * h * k.shape[2] * 4))
    out = torch.empty(b, h, lq, d, dtype=torch.float32, device=q.device)
    lse = torch.empty(b, h, lq, dtype=torch.float32, device=q.device)
    kf, vf = k.float(), v.float()
    for start in range(0, lq, rows):
        scores = (q[:, :, start:start + rows].float() * scale) @ kf.transpose(-1, -2)
        lse[:, :, start:start + rows] = torch.logsumexp(scores, dim=-1)
        out[:, :, start:start + rows] = torch.softmax(scores, dim=-1) @ vf
    return out, lse


def merge(out: torch.Tensor | None, lse: torch.Tensor | None, part: torch.Tensor,
          part_lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Join two attention results over disjoint key sets: the softmax over the union, from
    each part's output and log-sum-exp (float32)."""
    if out is None:
        return part, part_lse
    joined = torch.logaddexp(lse, part_lse)
    out = out * torch.exp(lse - joined)[..., None] + part * torch.exp(part_lse - joined)[..., None]
    return out, joined
