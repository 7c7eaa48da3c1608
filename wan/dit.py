"""The Wan diffusion transformer (Wan2.1 T2V/I2V, Wan2.2 TI2V-5B and A14B experts): the patch,
time, text and image embeddings, the blocks (dit_block.py) and the head.

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
from functools import partial
from typing import Callable, Iterable

import torch
import torch.nn as nn
import torch.nn.functional as F

from .attention import get_backend
from .chunks import checks_between_chunks, group_rows, row_chunks
from .compiled_blocks import OwedUpdate, compiled_block_forward
from .configs import DiTConfig
from .dit_block import WanBlock
from .glue import add_gated_, layer_norm, modulate
from .rope import RotaryTable

# A step cache's hook around the transformer blocks (sampling/residual_cache.py):
# hook(tokens, e, e0, run_blocks) -> the tokens the head gets. tokens: [B, L, D] float32, the
# residual stream entering the first block (run_blocks updates it in place); e [B, G, D] and
# e0 [B, G, 6, D]: the time embedding and its projection; run_blocks(tokens) runs every block
# (block swap, compiled and row-chunked blocks included) and returns the last block's output.
BlockStackHook = Callable[[torch.Tensor, torch.Tensor, torch.Tensor,
                           Callable[[torch.Tensor], torch.Tensor]], torch.Tensor]


def linear_fp32(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """A linear layer computed in float32 whatever dtype its weights are stored in."""
    bias = None if layer.bias is None else layer.bias.float()
    return F.linear(x.float(), layer.weight.float(), bias)


def mlp_fp32(layers: nn.Sequential, x: torch.Tensor) -> torch.Tensor:
    for layer in layers:
        x = linear_fp32(layer, x) if isinstance(layer, nn.Linear) else layer(x)
    return x


class Head(nn.Module):

    def __init__(self, cfg: DiTConfig):
        super().__init__()
        self.eps = cfg.eps
        self.head = nn.Linear(cfg.dim, math.prod(cfg.patch_size) * cfg.out_dim)
        self.modulation = nn.Parameter(torch.zeros(1, 2, cfg.dim))

    def forward(self, x: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        """Modulated by e (the time embedding), not by the projection e0. Over row chunks: the
        float32 norm and modulation of all rows at once would be the forward's largest
        temporaries (three times the residual stream)."""
        shift, scale = (self.modulation.float() + e[:, :, None]).unbind(2)
        length = x.shape[1]
        out = None
        for start, end in row_chunks(length, e.shape[1]):
            rows = modulate(layer_norm(x[:, start:end], self.eps),
                            group_rows(shift, start, end, length),
                            group_rows(scale, start, end, length))
            part = linear_fp32(self.head, rows)
            if out is None:
                out = part.new_empty(x.shape[0], length, part.shape[-1])
            out[:, start:end] = part
        return out


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
                compiled: bool = False,
                between_blocks: Callable[[], None] = lambda: None,
                sequence=None, block_stack: BlockStackHook | None = None) -> torch.Tensor:
        """Velocity prediction, float32, shaped like x.

        x: [B, C, F, H, W] noisy latent; y: optional conditioning channels concatenated to x
        (image-to-video); t: timesteps on the 0..1000 scale, taken as given (never rounded);
        context: [B, L, 4096] umT5 rows; clip_tokens: [B, 257, 1280] for Wan2.1 I2V.
        `blocks` lets an offloader supply the blocks as they become resident (default: self.blocks).
        compiled: run the blocks through torch.compile (wan/compiled_blocks.py).
        between_blocks(): called before every block and between the row chunks of a block's
        phases (wan/chunks.py checked); the caller's interrupt check raises there.
        sequence: this process computes one shard of the token rows, the others of its process
        group the rest (distributed/sequence_split.py SequenceSplit); the output is whole.
        block_stack: a step cache's say over the blocks (BlockStackHook); None runs them.
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
        attend = get_backend(attention, tokens.device, self.config.head_dim)

        # compiled blocks take the attention phases in one pass: unrolled over row chunks, the
        # compiled graph ran slower and kept more alive (14B 720p, H100: 12.2 s and 16.7 GiB of
        # activations against 11.3 s and 5.8 GiB); the FFN stays chunked either way
        attention_rows = tokens.shape[1] if compiled else None
        if sequence is not None:  # the attention phases in one pass: one exchange per block
            tokens, e, e0, rope, attend = sequence.shard(tokens, grid, e, e0, rope, attend,
                                                         self.config.num_heads)
            attention_rows = tokens.shape[1]
        if block_stack is None:
            tokens = self._run_blocks(tokens, blocks, e0, rope, text, image, attend, compiled,
                                      attention_rows, between_blocks)
        else:
            if sequence is not None:
                raise ValueError("a step cache (block_stack) runs on one process; this forward "
                                 "is split over several (sequence)")
            tokens = block_stack(tokens, e, e0, partial(
                self._run_blocks, blocks=blocks, e0=e0, rope=rope, text=text, image=image,
                attend=attend, compiled=compiled, attention_rows=attention_rows,
                between_blocks=between_blocks))
        out = self.head(tokens, e)
        if sequence is not None:
            out = sequence.gather(out)
        return self.unpatchify(out, grid)

    def _run_blocks(self, tokens: torch.Tensor, blocks, e0, rope, text, image, attend,
                    compiled: bool, attention_rows, between_blocks) -> torch.Tensor:
        """Every block over `tokens` (updated in place), the last one's output returned."""
        compiled_forward = compiled_block_forward() if compiled else None
        owed = OwedUpdate() if compiled else None  # the last FFN's update, added by the next block
        with checks_between_chunks(between_blocks):  # and between a block's row chunks
            for block in (self.blocks if blocks is None else blocks):
                between_blocks()
                args = (tokens, e0, rope, text, image, attend, self.compute_dtype, attention_rows)
                tokens = compiled_forward(block, *args, owed=owed) if compiled else block(*args)
        if owed is not None and owed.update is not None:
            add_gated_(tokens, *owed.take())
        return tokens


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
