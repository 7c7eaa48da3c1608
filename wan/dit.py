"""The Wan diffusion transformer (Wan2.1 T2V/I2V, Wan2.2 TI2V-5B and A14B experts).

Parameter names equal the official checkpoint keys, so official and ComfyUI files load strictly.

Numerics: the residual stream, norms, modulation, time/text embeddings and the head run in
float32; the block linears (attention projections, FFN) run in `compute_dtype` (bf16 on a GPU).
The time sinusoid and the RoPE angles are computed in float64.

Timesteps may be one per sample [B], one per latent frame [B, F] or one per token [B, L]
(Wan2.2 TI2V conditions the first frame at t=0). Modulation is kept per group of tokens that
share a timestep ([B, G, 6, D], G in {1, F, L}) instead of per token, which for a 720p video saves
gigabytes over expanding it to every token.
"""

from __future__ import annotations

import math
from typing import Iterable

import torch
import torch.nn as nn
import torch.nn.functional as F

from .attention import get_backend
from .configs import DiTConfig
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


def layer_norm(x: torch.Tensor, eps: float, norm: nn.LayerNorm | None = None) -> torch.Tensor:
    """float32 LayerNorm; without `norm` it has no affine parameters."""
    if norm is None:
        return F.layer_norm(x.float(), (x.shape[-1],), eps=eps)
    return F.layer_norm(x.float(), (x.shape[-1],), norm.weight.float(), norm.bias.float(), eps)


def linear_fp32(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """A linear layer computed in float32 whatever dtype its weights are stored in."""
    bias = None if layer.bias is None else layer.bias.float()
    return F.linear(x.float(), layer.weight.float(), bias)


def mlp_fp32(layers: nn.Sequential, x: torch.Tensor) -> torch.Tensor:
    for layer in layers:
        x = linear_fp32(layer, x) if isinstance(layer, nn.Linear) else layer(x)
    return x


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x * (1 + scale) + shift, with shift/scale [B, G, D] shared by groups of L/G tokens."""
    b, length, d = x.shape
    groups = shift.shape[1]
    grouped = x.view(b, groups, length // groups, d)
    return (grouped * (1 + scale[:, :, None]) + shift[:, :, None]).view(b, length, d)


def add_gated_(x: torch.Tensor, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """x += y * gate, in place, in float32 (y is upcast), with gate [B, G, D] shared by groups
    of tokens. In place: the float32 residual stream is the largest tensor of a step, and a new
    one per update would double it."""
    b, length, d = x.shape
    groups = gate.shape[1]
    x.view(b, groups, length // groups, d).addcmul_(y.view(b, groups, length // groups, d),
                                                   gate[:, :, None])
    return x


# Token rows per FFN pass: its hidden activation, ffn_dim wide and held twice (before and after
# the GELU), then exists for one chunk at a time: at 14B 720p 0.84 GiB instead of 4.2 GiB.
FFN_CHUNK_TOKENS = 8192


def feed_forward(ffn: nn.Sequential, h: torch.Tensor,
                 chunk: int = FFN_CHUNK_TOKENS) -> torch.Tensor:
    """The FFN over chunks of token rows (rows are independent, so it is the same function)."""
    length = h.shape[1]
    if length <= chunk:
        return ffn(h)
    out = None
    for start in range(0, length, chunk):
        part = ffn(h[:, start:start + chunk])
        if out is None:
            out = part.new_empty(h.shape[0], length, part.shape[-1])
        out[:, start:start + part.shape[1]] = part
        del part
    return out


class SelfAttention(nn.Module):

    def __init__(self, dim: int, num_heads: int, eps: float):
        super().__init__()
        self.num_heads = num_heads
        self.q = nn.Linear(dim, dim)
        self.k = nn.Linear(dim, dim)
        self.v = nn.Linear(dim, dim)
        self.o = nn.Linear(dim, dim)
        self.norm_q = RMSNorm(dim, eps)
        self.norm_k = RMSNorm(dim, eps)

    def forward(self, x: torch.Tensor, rope: RotaryTable, attend) -> torch.Tensor:
        b, length, dim = x.shape
        heads = (b, length, self.num_heads, dim // self.num_heads)
        q = rope.rotate(self.norm_q(self.q(x)).view(heads))
        k = rope.rotate(self.norm_k(self.k(x)).view(heads))
        v = self.v(x).view(heads)
        return self.o(attend(q, k, v).reshape(b, length, dim))


class CrossAttention(nn.Module):
    """Attention from video tokens to the text rows (all rows, no mask) and, for Wan2.1 I2V,
    separately to the CLIP image tokens; the two results are summed before the output projection."""

    def __init__(self, dim: int, num_heads: int, eps: float, image_branch: bool):
        super().__init__()
        self.num_heads = num_heads
        self.q = nn.Linear(dim, dim)
        self.k = nn.Linear(dim, dim)
        self.v = nn.Linear(dim, dim)
        self.o = nn.Linear(dim, dim)
        self.norm_q = RMSNorm(dim, eps)
        self.norm_k = RMSNorm(dim, eps)
        if image_branch:
            self.k_img = nn.Linear(dim, dim)
            self.v_img = nn.Linear(dim, dim)
            self.norm_k_img = RMSNorm(dim, eps)

    def _heads(self, t: torch.Tensor) -> torch.Tensor:
        return t.view(t.shape[0], t.shape[1], self.num_heads, -1)

    def forward(self, x, context, image_context, attend) -> torch.Tensor:
        b, length, dim = x.shape
        q = self._heads(self.norm_q(self.q(x)))
        k = self._heads(self.norm_k(self.k(context)))
        out = attend(q, k, self._heads(self.v(context)))
        if image_context is not None:
            k_img = self._heads(self.norm_k_img(self.k_img(image_context)))
            out = out + attend(q, k_img, self._heads(self.v_img(image_context)))
        return self.o(out.reshape(b, length, dim))


class WanBlock(nn.Module):

    def __init__(self, cfg: DiTConfig):
        super().__init__()
        dim = cfg.dim
        self.eps = cfg.eps
        self.self_attn = SelfAttention(dim, cfg.num_heads, cfg.eps)
        # cross-attention pre-norm: affine, not modulated
        self.norm3 = nn.LayerNorm(dim, eps=cfg.eps) if cfg.cross_attn_norm else None
        self.cross_attn = CrossAttention(dim, cfg.num_heads, cfg.eps, cfg.image_embedding)
        self.ffn = nn.Sequential(nn.Linear(dim, cfg.ffn_dim), nn.GELU(approximate="tanh"),
                                 nn.Linear(cfg.ffn_dim, dim))
        self.modulation = nn.Parameter(torch.zeros(1, 6, dim))

    def forward(self, x, e0, rope, context, image_context, attend, compute_dtype):
        """x: float32 [B, L, D] residual stream, updated in place and returned; e0: float32
        [B, G, 6, D] time projection."""
        shift_sa, scale_sa, gate_sa, shift_ff, scale_ff, gate_ff = (
            self.modulation.float() + e0).unbind(2)

        # x is updated in place; each h is cast at once so no float32 copy outlives its use
        h = modulate(layer_norm(x, self.eps), shift_sa, scale_sa).to(compute_dtype)
        add_gated_(x, self.self_attn(h, rope, attend), gate_sa)

        h = (x if self.norm3 is None else layer_norm(x, self.eps, self.norm3)).to(compute_dtype)
        x.add_(self.cross_attn(h, context, image_context, attend))

        h = modulate(layer_norm(x, self.eps), shift_ff, scale_ff).to(compute_dtype)
        return add_gated_(x, feed_forward(self.ffn, h), gate_ff)


class Head(nn.Module):

    def __init__(self, cfg: DiTConfig):
        super().__init__()
        self.eps = cfg.eps
        self.head = nn.Linear(cfg.dim, math.prod(cfg.patch_size) * cfg.out_dim)
        self.modulation = nn.Parameter(torch.zeros(1, 2, cfg.dim))

    def forward(self, x: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        """Modulated by e (the time embedding), not by the projection e0."""
        shift, scale = (self.modulation.float() + e[:, :, None]).unbind(2)
        return linear_fp32(self.head, modulate(layer_norm(x, self.eps), shift, scale))


class ImageEmbedding(nn.Module):
    """Projects CLIP image tokens [B, 257, 1280] (FLF2V: two images) into the model width."""

    def __init__(self, cfg: DiTConfig, flf_tokens: int = 514):
        super().__init__()
        d_img = cfg.image_dim
        self.proj = nn.Sequential(nn.LayerNorm(d_img), nn.Linear(d_img, d_img), nn.GELU(),
                                  nn.Linear(d_img, cfg.dim), nn.LayerNorm(cfg.dim))
        if cfg.image_pos_embedding:
            self.emb_pos = nn.Parameter(torch.zeros(1, flf_tokens, d_img))

    def forward(self, clip_tokens: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "emb_pos"):
            b, n, d = clip_tokens.shape
            clip_tokens = clip_tokens.reshape(-1, 2 * n, d) + self.emb_pos
        x = clip_tokens.float()
        for layer in self.proj:
            if isinstance(layer, nn.LayerNorm):
                x = layer_norm(x, layer.eps, layer)
            else:
                x = linear_fp32(layer, x) if isinstance(layer, nn.Linear) else layer(x)
        return x


def sinusoidal_embedding(t: torch.Tensor, dim: int) -> torch.Tensor:
    """[cos | sin] of t * 10000^(-i/half), computed in float64, returned as float32."""
    half = dim // 2
    t64 = t.to(torch.float64)
    freqs = torch.pow(10000.0, -torch.arange(half, dtype=torch.float64, device=t.device) / half)
    angles = torch.outer(t64, freqs)
    return torch.cat([torch.cos(angles), torch.sin(angles)], dim=1).float()


def group_timesteps(t: torch.Tensor, batch: int, grid: tuple[int, int, int]) -> torch.Tensor:
    """Timesteps as [B, G]: G = 1 (one per sample), F (per latent frame) or L (per token).

    Per-token timesteps that are constant within each frame are reduced to per-frame ones.
    """
    frames, tokens = grid[0], math.prod(grid)
    t = t.reshape(t.shape[0], -1) if t.dim() > 0 else t.reshape(1, 1)
    if t.shape[0] == 1 and batch > 1:
        t = t.expand(batch, -1)
    if t.shape[0] != batch:
        raise ValueError(f"timestep batch {t.shape[0]} does not match the latent batch {batch}")
    groups = t.shape[1]
    if groups not in (1, frames, tokens):
        raise ValueError(f"timesteps of shape {list(t.shape)}: expected [B], [B, {frames}] "
                         f"(per latent frame) or [B, {tokens}] (per token)")
    if groups == tokens and tokens != frames:
        per_frame = t.view(batch, frames, -1)
        if bool((per_frame == per_frame[:, :, :1]).all()):
            t = per_frame[:, :, 0]
    return t


class WanDiT(nn.Module):

    def __init__(self, config: DiTConfig, compute_dtype: torch.dtype = torch.float32):
        super().__init__()
        self.config = config
        self.compute_dtype = compute_dtype
        cfg = config
        dim = cfg.dim
        self.patch_embedding = nn.Conv3d(cfg.in_dim, dim, kernel_size=cfg.patch_size,
                                         stride=cfg.patch_size)
        self.text_embedding = nn.Sequential(nn.Linear(cfg.text_dim, dim),
                                            nn.GELU(approximate="tanh"), nn.Linear(dim, dim))
        self.time_embedding = nn.Sequential(nn.Linear(cfg.freq_dim, dim), nn.SiLU(),
                                            nn.Linear(dim, dim))
        self.time_projection = nn.Sequential(nn.SiLU(), nn.Linear(dim, 6 * dim))
        self.blocks = nn.ModuleList(WanBlock(cfg) for _ in range(cfg.num_layers))
        self.head = Head(cfg)
        if cfg.image_embedding:
            self.img_emb = ImageEmbedding(cfg)

    # -- embeddings -------------------------------------------------------------------------

    def embed_time(self, t: torch.Tensor, batch: int, grid) -> tuple[torch.Tensor, torch.Tensor]:
        """e [B, G, D] for the head and e0 [B, G, 6, D] for the blocks, float32."""
        grouped = group_timesteps(t.to(self.patch_embedding.weight.device), batch, grid)
        b, groups = grouped.shape
        sinusoid = sinusoidal_embedding(grouped.flatten(), self.config.freq_dim)
        e = mlp_fp32(self.time_embedding, sinusoid).view(b, groups, -1)
        e0 = mlp_fp32(self.time_projection, e).view(b, groups, 6, -1)
        return e, e0

    def embed_text(self, context: torch.Tensor) -> torch.Tensor:
        """Zero-pad the text rows to text_len before embedding: the padded rows become
        embeddings of a zero vector and take part in cross-attention (no mask)."""
        b, length, width = context.shape
        if width != self.config.text_dim:
            raise ValueError(f"text conditioning has width {width}; this model expects "
                             f"{self.config.text_dim} (umT5-xxl)")
        if length < self.config.text_len:
            context = F.pad(context, (0, 0, 0, self.config.text_len - length))
        return mlp_fp32(self.text_embedding, context)

    def patchify(self, x: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int, int]]:
        b, c, f, h, w = x.shape
        pt, ph, pw = self.config.patch_size
        if c != self.config.in_dim:
            raise ValueError(f"latent has {c} channels; this model expects {self.config.in_dim}")
        if f % pt or h % ph or w % pw:
            raise ValueError(f"latent size {f}x{h}x{w} is not a multiple of the patch "
                             f"{pt}x{ph}x{pw}")
        conv = self.patch_embedding
        tokens = F.conv3d(x.float(), conv.weight.float(), conv.bias.float(), stride=conv.stride)
        grid = tuple(tokens.shape[2:])
        # contiguous: the blocks update this residual stream in place through views
        return tokens.flatten(2).transpose(1, 2).contiguous(), grid

    def unpatchify(self, out: torch.Tensor, grid) -> torch.Tensor:
        """Token vectors ordered (pt, ph, pw, channel) back to [B, C, F, H, W]."""
        b = out.shape[0]
        f, h, w = grid
        pt, ph, pw = self.config.patch_size
        c = self.config.out_dim
        out = out.view(b, f, h, w, pt, ph, pw, c).permute(0, 7, 1, 4, 2, 5, 3, 6)
        return out.reshape(b, c, f * pt, h * ph, w * pw)

    # -- forward ----------------------------------------------------------------------------

    def forward(self, x: torch.Tensor, t: torch.Tensor, context: torch.Tensor, *,
                y: torch.Tensor | None = None, clip_tokens: torch.Tensor | None = None,
                attention: str = "sdpa", blocks: Iterable[nn.Module] | None = None,
                compiled: bool = False) -> torch.Tensor:
        """Velocity prediction, float32, shaped like x.

        x: [B, C, F, H, W] noisy latent; y: optional conditioning channels concatenated to x
        (image-to-video); t: timesteps on the 0..1000 scale, taken as given (never rounded);
        context: [B, L, 4096] umT5 rows; clip_tokens: [B, 257, 1280] for Wan2.1 I2V.
        `blocks` lets an offloader supply the blocks as they become resident (default: self.blocks).
        compiled: run the blocks through torch.compile (see compiled_block_forward).
        """
        if y is not None:
            x = torch.cat([x, y.to(x.dtype)], dim=1)
        batch = x.shape[0]
        tokens, grid = self.patchify(x)
        e, e0 = self.embed_time(t, batch, grid)
        text = self.embed_text(context.to(tokens.device)).to(self.compute_dtype)
        image = None
        if self.config.image_embedding:
            if clip_tokens is None:
                raise ValueError("this image-to-video model needs CLIP image tokens (clip_tokens)")
            image = self.img_emb(clip_tokens.to(tokens.device)).to(self.compute_dtype)
        if text.shape[0] != batch:
            text = text.expand(batch, -1, -1)
        rope = RotaryTable(grid, self.config.rope_pairs, device=tokens.device)
        attend = get_backend(attention)

        compiled_forward = compiled_block_forward() if compiled else None
        for block in (self.blocks if blocks is None else blocks):
            args = (tokens, e0, rope, text, image, attend, self.compute_dtype)
            tokens = compiled_forward(block, *args) if compiled else block(*args)

        return self.unpatchify(self.head(tokens, e), grid)


_COMPILED_BLOCK_FORWARD = None


def compiled_block_forward():
    """WanBlock.forward through torch.compile, made once per process and shared by every block of
    every model: the weights are graph inputs, so 30 or 40 blocks reuse one compiled graph. It
    fuses the float32 norms, modulation, RoPE and gated residuals around the matrix and attention
    kernels into a few Triton kernels (a forward's time drops by about a quarter on an H100). A
    new video shape compiles again (tens of seconds, once); values differ from the eager blocks
    by rounding only, since the fused kernels skip intermediate roundings."""
    global _COMPILED_BLOCK_FORWARD
    if _COMPILED_BLOCK_FORWARD is None:
        _COMPILED_BLOCK_FORWARD = torch.compile(WanBlock.forward, dynamic=False)
    return _COMPILED_BLOCK_FORWARD


def is_block_linear(key: str) -> bool:
    """Keys of the large block matrices that run in compute_dtype (and may be quantized)."""
    parts = key.split(".")
    return (len(parts) >= 5 and parts[0] == "blocks" and parts[-1] in ("weight", "bias")
            and (parts[2] in ("self_attn", "cross_attn") and parts[3] in
                 ("q", "k", "v", "o", "k_img", "v_img")
                 or parts[2] == "ffn"))


def keeps_float32(key: str) -> bool:
    """Norm gains and modulation tables stay float32 in any load dtype (they are tiny). Other
    tensors are stored in the load dtype; the embeddings and the head still compute in float32."""
    leaf_module = key.rsplit(".", 1)[0]
    return (key.endswith("modulation") or key == "img_emb.emb_pos"
            or leaf_module.split(".")[-1].startswith("norm")
            or leaf_module in ("img_emb.proj.0", "img_emb.proj.4"))
