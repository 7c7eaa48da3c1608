"""The umT5-xxl text encoder of Wan2.1 / Wan2.2.

Parameter names equal the official Wan checkpoint keys (`models_t5_umt5-xxl-enc-bf16.pth`);
`hf_key_to_wan` / `wan_key_to_hf` translate the HF / ComfyUI names (`umt5_xxl_fp16` and friends).

Numerics, as the model was trained: the token embedding is not scaled, attention has no
1/sqrt(head_dim) factor, every layer owns its relative-position bias (umT5, unlike T5 which
shares layer 0's), RMS norms without mean subtraction, FFN = fc2(gelu_tanh(gate(x)) * fc1(x)).

Precision: the residual stream is float32 whatever the weight dtype; norms run in float32 and
are cast to the weight dtype for the matmuls. In float16 (where T5 activations are known to
overflow) the sub-layer outputs are clamped to the finite float16 range and the FFN output
projection, whose outputs grow largest, runs in float32; bfloat16 has float32's range and runs
every matmul in bfloat16.
"""

from __future__ import annotations

import math
import re

import torch
import torch.nn as nn
import torch.nn.functional as F

from .configs import T5Config


def relative_position_buckets(length: int, num_buckets: int, max_distance: int,
                              device=None) -> torch.Tensor:
    """Bidirectional bucket index [query, key] for self-attention over `length` tokens.

    Half the buckets serve keys at or before the query, half keys after it (key - query > 0
    adds the offset). Within a half, distances below half of it get one bucket each, larger ones
    share logarithmically wider buckets up to `max_distance`; farther ones fall into the last.
    The logarithm is taken in float32 in this exact order, because the trained weights assume
    the bucket boundaries that arithmetic gives.
    """
    positions = torch.arange(length, dtype=torch.long, device=device)
    offset = positions[None, :] - positions[:, None]
    per_side = num_buckets // 2
    side = (offset > 0).long() * per_side
    distance = offset.abs()
    exact = per_side // 2
    # distances below `exact` never use this branch; clamping keeps log() away from 0
    scaled = torch.log(distance.clamp(min=exact).float() / exact) / math.log(max_distance / exact)
    logarithmic = exact + (scaled * (per_side - exact)).long()
    logarithmic = logarithmic.clamp(max=per_side - 1)
    return side + torch.where(distance < exact, distance, logarithmic)


def key_padding_bias(mask: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[B, L] mask (0 = padding) -> [B, 1, 1, L] additive bias: the most negative value of
    `dtype` at padded keys, 0 elsewhere."""
    blocked = (mask == 0)[:, None, None, :]
    zero = torch.zeros((), dtype=dtype, device=mask.device)
    return torch.where(blocked, torch.finfo(dtype).min, zero)


def stream_dtype(dtype: torch.dtype) -> torch.dtype:
    """The residual stream's dtype for weights of `dtype`: float32, or float64 for float64."""
    return torch.promote_types(dtype, torch.float32)


def clamp_to_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Clamp float32 values into the finite range of `dtype` so the cast cannot make infinities."""
    limit = torch.finfo(dtype).max
    return x.clamp(-limit, limit)


def finite_half(x: torch.Tensor) -> torch.Tensor:
    """float16 results that overflowed become the largest finite value instead of inf."""
    if x.dtype != torch.float16:
        return x
    limit = torch.finfo(torch.float16).max
    return x.clamp(-limit, limit)


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in float32 and returned in `dtype`."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        wide = stream_dtype(x.dtype)
        normed = F.rms_norm(x.to(wide), (x.shape[-1],), eps=self.eps)
        return (normed * self.weight.to(wide)).to(dtype)


class RelativePositionBias(nn.Module):
    """A learned scalar per (bucket, head), added to the attention scores."""

    def __init__(self, num_buckets: int, num_heads: int):
        super().__init__()
        self.embedding = nn.Embedding(num_buckets, num_heads)

    def forward(self, buckets: torch.Tensor) -> torch.Tensor:
        """[Lq, Lk] bucket index -> [1, heads, Lq, Lk] in float32 (or float64)."""
        weight = self.embedding.weight
        return F.embedding(buckets, weight.to(stream_dtype(weight.dtype))).permute(2, 0, 1)[None]


class Attention(nn.Module):
    """Multi-head self-attention with an additive bias and no score scaling."""

    def __init__(self, dim: int, dim_attn: int, num_heads: int):
        super().__init__()
        if dim_attn % num_heads:
            raise ValueError(f"dim_attn {dim_attn} is not divisible by num_heads {num_heads}")
        self.num_heads = num_heads
        self.q = nn.Linear(dim, dim_attn, bias=False)
        self.k = nn.Linear(dim, dim_attn, bias=False)
        self.v = nn.Linear(dim, dim_attn, bias=False)
        self.o = nn.Linear(dim_attn, dim, bias=False)

    def _split_heads(self, t: torch.Tensor) -> torch.Tensor:
        b, length, _ = t.shape
        return t.view(b, length, self.num_heads, -1).transpose(1, 2)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """x [B, L, dim] in the weight dtype; bias [1 or B, heads, L, L] in the same dtype."""
        q = self._split_heads(finite_half(self.q(x)))
        k = self._split_heads(finite_half(self.k(x)))
        v = self._split_heads(finite_half(self.v(x)))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=1.0)
        b, _, length, _ = out.shape
        return finite_half(self.o(out.transpose(1, 2).reshape(b, length, -1)))


class GatedFeedForward(nn.Module):
    """fc2(gelu_tanh(gate(x)) * fc1(x)); `gate` is a Sequential so its weight is `gate.0.weight`."""

    def __init__(self, dim: int, dim_ffn: int):
        super().__init__()
        self.gate = nn.Sequential(nn.Linear(dim, dim_ffn, bias=False), nn.GELU(approximate="tanh"))
        self.fc1 = nn.Linear(dim, dim_ffn, bias=False)
        self.fc2 = nn.Linear(dim_ffn, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gated = finite_half(self.gate(x))
        linear = finite_half(self.fc1(x))
        if x.dtype != torch.float16:
            return self.fc2(gated * linear)
        # float16: the product and the projection back to the model width are where T5's
        # activations exceed 65504, so both run in float32
        return F.linear(gated.float() * linear.float(), float32_weight(self.fc2))


def float32_weight(layer: nn.Module) -> torch.Tensor:
    """A linear layer's weight in float32: dequantized for a quantized layer (fp8 files keep
    codes and scales; the codes alone are not the weight), else widened."""
    dequantize = getattr(layer, "dequantized_weight", None)
    return dequantize(torch.float32) if dequantize is not None else layer.weight.float()


class EncoderBlock(nn.Module):

    def __init__(self, dim: int, dim_attn: int, dim_ffn: int, num_heads: int, num_buckets: int,
                 eps: float):
        super().__init__()
        self.norm1 = RMSNorm(dim, eps)
        self.attn = Attention(dim, dim_attn, num_heads)
        self.norm2 = RMSNorm(dim, eps)
        self.ffn = GatedFeedForward(dim, dim_ffn)
        self.pos_embedding = RelativePositionBias(num_buckets, num_heads)

    def forward(self, x: torch.Tensor, buckets: torch.Tensor,
                padding_bias: torch.Tensor | None) -> torch.Tensor:
        """x: residual stream [B, L, dim] (float32, float64 for float64 weights);
        buckets [L, L]; padding_bias [B, 1, 1, L] in the residual dtype."""
        dtype = compute_dtype(self.attn.q)
        bias = self.pos_embedding(buckets)
        if padding_bias is not None:
            bias = bias + padding_bias
        bias = clamp_to_dtype(bias, dtype).to(dtype)
        x = x + self.attn(self.norm1(x, dtype), bias).to(x.dtype)
        return x + self.ffn(self.norm2(x, dtype)).to(x.dtype)


def compute_dtype(layer: nn.Module) -> torch.dtype:
    """The dtype a block computes in: its weights', or for 8-bit weights (fp8 files kept as
    stored, dequantized per matmul) the dtype they are dequantized to."""
    return getattr(layer, "compute_dtype", None) or layer.weight.dtype


def is_block_matrix(key: str) -> bool:
    """Keys of the encoder blocks' attention and feed-forward matrices (nearly all of the
    weights; a scaled-fp8 file stores these in fp8)."""
    parts = key.split(".")
    return (len(parts) >= 5 and parts[0] == "blocks" and parts[-1] == "weight"
            and parts[2] in ("attn", "ffn") and parts[3] in ("q", "k", "v", "o", "gate", "fc1",
                                                          "fc2"))


class UMT5Encoder(nn.Module):
    """umT5 encoder: ids [B, L] (+ mask) -> last hidden state [B, L, dim] after the final norm.

    The defaults are umt5-xxl, the text encoder of every Wan2.1 / Wan2.2 model.
    """

    def __init__(self, vocab_size: int = 256384, dim: int = 4096, dim_attn: int = 4096,
                 dim_ffn: int = 10240, num_heads: int = 64, num_layers: int = 24,
                 num_buckets: int = 32, max_distance: int = 128, eps: float = 1e-6):
        super().__init__()
        self.num_buckets = num_buckets
        self.max_distance = max_distance
        self.token_embedding = nn.Embedding(vocab_size, dim)
        self.blocks = nn.ModuleList(
            EncoderBlock(dim, dim_attn, dim_ffn, num_heads, num_buckets, eps)
            for _ in range(num_layers))
        self.norm = RMSNorm(dim, eps)

    @classmethod
    def from_config(cls, config: T5Config) -> "UMT5Encoder":
        return cls(**config.to_dict())

    def forward(self, ids: torch.Tensor, mask: torch.Tensor | None = None, *,
                blocks=None, device: torch.device | str | None = None) -> torch.Tensor:
        """ids int64 [B, L]; mask [B, L] with 0 at padding (None: no padding).

        Returns float32 [B, L, dim] (float64 for float64 weights). Every position is computed,
        padding included; valid positions do not depend on how much padding follows. Pipelines
        zero the padding rows (or cut them off) before the DiT sees them.

        For streaming, `blocks` supplies the blocks as they become resident on `device`, where
        the blocks and the final norm compute; the embedding lookup happens wherever the
        embedding is (ids must be there), so its large table never has to move.
        """
        device = torch.device(device) if device is not None else ids.device
        x, padding_bias = self._inputs(ids, mask, device)
        buckets = relative_position_buckets(ids.shape[1], self.num_buckets, self.max_distance,
                                            device=device)
        for block in (self.blocks if blocks is None else blocks):
            x = block(x, buckets, padding_bias)
        return self.norm(x, x.dtype)

    def forward_each(self, ids: torch.Tensor, mask: torch.Tensor | None = None, *,
                     blocks=None, device: torch.device | str | None = None
                     ) -> list[torch.Tensor]:
        """forward for each row of ids alone (a batch of one each: a row's result does not
        depend on the rows beside it), every block applied to all rows before the next block
        (streamed blocks cross to the device once for all rows). Returns [1, L, dim] per row."""
        device = torch.device(device) if device is not None else ids.device
        rows = [self._inputs(ids[i:i + 1], None if mask is None else mask[i:i + 1], device)
                for i in range(ids.shape[0])]
        buckets = relative_position_buckets(ids.shape[1], self.num_buckets, self.max_distance,
                                            device=device)
        xs = [x for x, _ in rows]
        for block in (self.blocks if blocks is None else blocks):
            xs = [block(x, buckets, bias) for x, (_, bias) in zip(xs, rows)]
        return [self.norm(x, x.dtype) for x in xs]

    def _inputs(self, ids: torch.Tensor, mask: torch.Tensor | None, device: torch.device):
        """The embedded tokens on `device` in the blocks' dtype, and the padding bias."""
        x = self.token_embedding(ids)  # the table may be stored narrower than the blocks
        x = x.to(device=device, dtype=stream_dtype(self.norm.weight.dtype))
        return x, None if mask is None else key_padding_bias(mask.to(device), x.dtype)


# ---------------------------------------------------------------------------------------------
# HF / ComfyUI key names

# HF keeps two names for the one embedding matrix; `shared.weight` is the stored one.
_HF_EMBEDDING_NAMES = ("shared.weight", "encoder.embed_tokens.weight")
_HF_TOP = {"encoder.final_layer_norm.weight": "norm.weight"}
_WAN_TOP = {wan: hf for hf, wan in _HF_TOP.items()}
_HF_BLOCK_RE = re.compile(r"encoder\.block\.(\d+)\.(layer\.[01]\..+)")
_WAN_BLOCK_RE = re.compile(r"blocks\.(\d+)\.(.+)")
_HF_IN_BLOCK = {
    "layer.0.layer_norm.weight": "norm1.weight",
    "layer.0.SelfAttention.q.weight": "attn.q.weight",
    "layer.0.SelfAttention.k.weight": "attn.k.weight",
    "layer.0.SelfAttention.v.weight": "attn.v.weight",
    "layer.0.SelfAttention.o.weight": "attn.o.weight",
    "layer.0.SelfAttention.relative_attention_bias.weight": "pos_embedding.embedding.weight",
    "layer.1.layer_norm.weight": "norm2.weight",
    "layer.1.DenseReluDense.wi_0.weight": "ffn.gate.0.weight",  # the GELU branch
    "layer.1.DenseReluDense.wi_1.weight": "ffn.fc1.weight",
    "layer.1.DenseReluDense.wo.weight": "ffn.fc2.weight",
}
_WAN_IN_BLOCK = {wan: hf for hf, wan in _HF_IN_BLOCK.items()}


def hf_key_to_wan(key: str) -> str | None:
    """HF / ComfyUI UMT5 encoder key -> our (official Wan) key; None for keys that are not part
    of the encoder (a decoder, `spiece_model`, quantization scales, ...). Both names of the tied
    embedding map to `token_embedding.weight`."""
    if key in _HF_EMBEDDING_NAMES:
        return "token_embedding.weight"
    if key in _HF_TOP:
        return _HF_TOP[key]
    match = _HF_BLOCK_RE.fullmatch(key)
    if match and match.group(2) in _HF_IN_BLOCK:
        return f"blocks.{match.group(1)}.{_HF_IN_BLOCK[match.group(2)]}"
    return None


def wan_key_to_hf(key: str) -> str | None:
    """Our (official Wan) key -> HF / ComfyUI key; None for unknown keys. The embedding maps to
    `shared.weight`; files that also store `encoder.embed_tokens.weight` hold the same tensor."""
    if key == "token_embedding.weight":
        return _HF_EMBEDDING_NAMES[0]
    if key in _WAN_TOP:
        return _WAN_TOP[key]
    match = _WAN_BLOCK_RE.fullmatch(key)
    if match and match.group(2) in _WAN_IN_BLOCK:
        return f"encoder.block.{match.group(1)}.{_WAN_IN_BLOCK[match.group(2)]}"
    return None


def state_dict_from_hf(hf_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """An HF / ComfyUI encoder state dict under our names. Every key must be an encoder key;
    when both names of the tied embedding are present they must hold the same values."""
    unknown = sorted(k for k in hf_state if hf_key_to_wan(k) is None)
    if unknown:
        more = " ..." if len(unknown) > 8 else ""
        raise ValueError(f"not umT5 encoder keys: {unknown[:8]}{more}")
    out = {hf_key_to_wan(k): v for k, v in hf_state.items() if k not in _HF_EMBEDDING_NAMES}
    stored = [hf_state[k] for k in _HF_EMBEDDING_NAMES if k in hf_state]
    if stored:
        if len(stored) == 2 and not torch.equal(stored[0], stored[1]):
            raise ValueError("shared.weight and encoder.embed_tokens.weight differ, but the "
                             "encoder uses one matrix for both")
        out["token_embedding.weight"] = stored[0]
    return out
