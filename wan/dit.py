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
from typing import Callable, Iterable, NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..quant.gelu_fp8 import gelu_quantize_in_pieces
from ..quant.linear import layer_output_bytes
from ..quant.rowwise import RowCodes
from .attention import get_backend, wave_rows
from .compiled_blocks import OwedUpdate, compiled_block_forward
from .configs import DiTConfig
from .fp8_attention import fp8_attention, fp8_attention_normed_query, fp8_keys
from .glue import (add_gated_, gelu_product_weights, layer_norm, linear_gelu, modulate, norm_affine,
                   norm_codes, norm_modulate, rms_norm_heads, takes_row_codes)
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


def linear_fp32(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """A linear layer computed in float32 whatever dtype its weights are stored in."""
    bias = None if layer.bias is None else layer.bias.float()
    return F.linear(x.float(), layer.weight.float(), bias)


def mlp_fp32(layers: nn.Sequential, x: torch.Tensor) -> torch.Tensor:
    for layer in layers:
        x = linear_fp32(layer, x) if isinstance(layer, nn.Linear) else layer(x)
    return x


# Token rows per pass through a block. Each of the block's three phases (self-attention,
# cross-attention, feed-forward) runs over chunks of this many rows, so its float32 norms and
# modulation, its projections and the FFN's hidden activation exist for one chunk at a time:
# at 14B 720p (75,600 tokens) a chunk's temporaries are a tenth of the full ones, and the block's
# peak is the residual stream plus the self-attention keys and values (H100, one forward: 5.8
# GiB of activations instead of 8.0, for 4% more time).
ROW_CHUNK_TOKENS = 8192

# An eager self-attention phase of at most this many row chunks holds every chunk's norm codes
# (1 byte a value) from its keys' and values' pass until its queries take them, instead of a
# second norm pass per chunk: all of them together are then at most what one chunk's queries and
# attention output take (bf16: 4 bytes a value of one chunk). Measured: faster at 5B and 1.3B
# (4 chunks) with the same peaks; over 14B's chunks the held codes raised the peak
# (bench/results/2026-11-26-h100-eager-held-codes/).
HELD_CODE_CHUNKS = 4

# The feed-forward phase runs in one pass while its hidden activation (rows x ffn_dim, at the
# bytes per element its first layer holds: hidden_bytes) stays under this many bytes, and in
# equal chunks beyond: a 5B 720p block (0.8 GB in bf16) runs whole, a 14B 720p one (2.1 GB) in
# three chunks, and with int8 W8A8 matrices (int32 products beside the bf16 output, 2.3 GB) the
# 5B block in three too.
FFN_HIDDEN_BYTES = 1 << 30


def row_chunks(length: int, groups: int, target: int | None = None,
               unit: int | None = None) -> list[tuple[int, int]]:
    """Row ranges [start, end) covering 0..length. With several timestep groups (per frame or
    per token) each range holds whole groups, so its modulation is a slice of the group tables.
    With `unit` (attention.wave_rows: query rows that fill whole waves of the GPU) each range but
    the last also holds a multiple of it, the multiple nearest `target`, where one holding both
    whole groups and whole units is at most 1.5 times `target`, which bounds what a chunk's
    temporaries may grow by (else unit is not taken)."""
    target = ROW_CHUNK_TOKENS if target is None else target
    if length <= target:
        return [(0, length)]
    per_group = length // groups if groups > 1 else 1
    step = max(1, target // per_group) * per_group
    both = math.lcm(per_group, unit) if unit else None
    if both is not None and 2 * both <= 3 * target:
        step = max(1, round(target / both)) * both
    return [(start, min(start + step, length)) for start in range(0, length, step)]


def hidden_bytes(first: nn.Module, dtype: torch.dtype) -> int:
    """Bytes per element of the FFN's hidden activation while its first layer makes it in
    `dtype` (quant/linear.py layer_output_bytes: a quantized layer's own count, else the
    dtype's size)."""
    return layer_output_bytes(first, dtype)


def ffn_chunks(length: int, groups: int, ffn_dim: int, itemsize: int) -> list[tuple[int, int]]:
    """Row ranges for the feed-forward phase: one when the hidden activation is small enough,
    else about equal ones (no short last chunk, whose matrix products run slowest)."""
    pieces = -(-length * ffn_dim * itemsize // FFN_HIDDEN_BYTES)
    return row_chunks(length, groups, -(-length // pieces))


def group_rows(table: torch.Tensor, start: int, end: int, length: int) -> torch.Tensor:
    """The part of a per-group table [B, G, D] that covers token rows [start, end)."""
    groups = table.shape[1]
    if groups == 1:
        return table
    per_group = length // groups
    return table[:, start // per_group:end // per_group]


class SelfAttention(nn.Module):
    """Every query attends to every key: the keys and values of all rows are made first, then the
    queries row chunk by row chunk (WanBlock runs the phases)."""

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


class ResidualUpdate(NamedTuple):
    """x += y * gate (gate [B, G, D] per group of tokens, or None), owed to the residual stream x:
    the compiled blocks hand a phase's update to the next phase's graph, which adds it in the pass
    of its own norm (wan/compiled_blocks.py)."""
    y: torch.Tensor
    gate: torch.Tensor | None


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

    def forward(self, x, e0, rope, context, image_context, attend, compute_dtype,
                attention_rows: int | None = None):
        """x: float32 [B, L, D] residual stream, updated in place and returned; e0: float32
        [B, G, 6, D] time projection. Self-attention, cross-attention, then the feed-forward.

        The attentions run over row chunks (row_chunks), both on a chunk before the next
        (attention_phases), the feed-forward over its own (ffn_chunks); each adds its output to
        those rows of x at once. That is exact: a row's queries, norms and FFN depend on that row
        alone, and the self-attention keys and values, which depend on all rows, are made before
        any row changes. attention_rows: the chunk size of the attentions (default
        ROW_CHUNK_TOKENS).
        """
        x = self.attention_phases(x, e0, rope, context, image_context, attend, compute_dtype,
                                  attention_rows)
        return self.feed_forward_phase(x, e0, compute_dtype)

    def attention_phases(self, x, e0, rope, context, image_context, attend, compute_dtype,
                         attention_rows: int | None = None):
        """Self-attention, then cross-attention, added to x (in place; returned), row chunk by
        row chunk: each chunk's self-attention update goes to that chunk's cross-attention,
        which adds it in its norm's pass where its query takes fp8 codes (glue.norm_codes), not
        in a pass of its own over x. The same as self_attention_phase then
        cross_attention_phase: a row's cross-attention reads that row alone."""
        codes = self._query_takes_codes(x)
        text_kv, image_kv = self.cross_attn.keys_values(context, image_context)

        def crossed(rows, update):
            add_gated_(rows, self._cross_attended(rows, text_kv, image_kv, attend, compute_dtype,
                                                  codes, update), None)
        return self.self_attention_phase(x, e0, rope, attend, compute_dtype, attention_rows,
                                         crossed)

    def _modulated(self, e0):
        """shift, scale, gate of self-attention, then of the FFN: float32 [B, G, D] each."""
        return (self.modulation.float() + e0).unbind(2)

    def _normed(self, x, start, end, shift, scale, compute_dtype, layers, pending=None):
        """The modulated norm of rows start..end, the input of `layers`: their fp8 codes where
        they all take them (glue.norm_codes: one pass, `pending` added in it), else in
        compute_dtype (`pending` added to x first). `pending` only with all rows."""
        length = x.shape[1]
        rows = x if (start, end) == (0, length) else x[:, start:end]
        shift, scale = group_rows(shift, start, end, length), group_rows(scale, start, end, length)
        if takes_row_codes(layers, x):
            return norm_codes(rows, self.eps, compute_dtype, shift=shift, scale=scale,
                              pending=pending)
        if pending is not None:
            add_gated_(x, *pending)
        return norm_modulate(rows, shift, scale, self.eps, compute_dtype)

    def self_attention_phase(self, x, e0, rope, attend, compute_dtype,
                             attention_rows: int | None = None, then=None):
        """Self-attention added to x (in place; returned). `then(rows, update)`: what is done
        with each row chunk's update (rows: those rows of x) instead of adding it."""
        length, groups = x.shape[1], e0.shape[1]
        attn = self.self_attn
        self_attend = _self_attend(attend)
        # chunks of query rows whose attention kernel launches fill whole waves of the GPU
        unit = wave_rows(self_attend, x.shape[0] * attn.num_heads, x.shape[2] // attn.num_heads,
                         x.device, compute_dtype)
        chunks = row_chunks(length, groups, attention_rows, unit)
        then = then or _add_update
        if len(chunks) == 1:  # one pass: keys and values straight from the projections
            then(x, self.self_attention_update(x, e0, rope, attend, compute_dtype))
            return x
        shift_sa, scale_sa, gate_sa = self._modulated(e0)[:3]

        def rows(table, start, end):
            return group_rows(table, start, end, length)

        def normed(start, end, shift, scale, layers):
            return self._normed(x, start, end, shift, scale, compute_dtype, layers)

        # where q, k and v all take the norm's fp8 codes, each chunk's codes are made once, for
        # its keys and values, and held until its queries take them (HELD_CODE_CHUNKS)
        shared = len(chunks) <= HELD_CODE_CHUNKS and takes_row_codes((attn.q, attn.k, attn.v), x)
        k, v, held = self._chunked_keys_values(x, chunks, normed, shift_sa, scale_sa, rope,
                                               compute_dtype, shared)
        # the fp8 backend's quantized keys, made once for all the chunks
        keys = fp8_keys(k, v) if self_attend is fp8_attention else None
        for start, end in chunks:
            h = held.pop(0) if shared else normed(start, end, shift_sa, scale_sa, (attn.q,))
            out = attn.attend_rows(h, rope, start, k, v, self_attend, keys)
            del h
            then(x[:, start:end], ResidualUpdate(out, rows(gate_sa, start, end)))
        del k, v, keys, out
        return x

    def self_attention_update(self, x, e0, rope, attend, compute_dtype,
                              pending: ResidualUpdate | None = None) -> ResidualUpdate:
        """Self-attention over all rows in one pass, returned as x's update, not added to x;
        `pending` (an update still owed to x) is added to x first."""
        shift_sa, scale_sa, gate_sa = self._modulated(e0)[:3]
        attn = self.self_attn
        h = self._normed(x, 0, x.shape[1], shift_sa, scale_sa, compute_dtype,
                         (attn.q, attn.k, attn.v), pending)
        k, v = attn.keys_values(h, rope, 0)
        return ResidualUpdate(attn.attend_rows(h, rope, 0, k, v, _self_attend(attend)), gate_sa)

    def cross_attention_phase(self, x, context, image_context, attend, compute_dtype,
                              attention_rows: int | None = None,
                              pending: ResidualUpdate | None = None):
        """Cross-attention to the text (and image) tokens added to x (in place; returned), over
        the same row chunks as self-attention; `pending` is added to x first (in the pass of
        the norm's codes where the query projection takes them: glue.norm_codes)."""
        chunks = row_chunks(x.shape[1], 1, attention_rows)
        codes = self._query_takes_codes(x)
        if pending is not None and len(chunks) != 1:  # owed to all rows: added before the chunks
            add_gated_(x, *pending)
            pending = None
        text_kv, image_kv = self.cross_attn.keys_values(context, image_context)
        for start, end in chunks:
            part = x if len(chunks) == 1 else x[:, start:end]
            add_gated_(part, self._cross_attended(part, text_kv, image_kv, attend, compute_dtype,
                                                  codes, pending), None)
        return x

    def cross_attention_update(self, x, context, image_context, attend, compute_dtype,
                               pending: ResidualUpdate | None = None) -> ResidualUpdate:
        """Cross-attention over all rows in one pass, returned as x's update, not added to x
        (the compiled blocks hand it to the FFN's norm: feed_forward_takes_update); `pending`
        is added to x first."""
        codes = self._query_takes_codes(x)
        text_kv, image_kv = self.cross_attn.keys_values(context, image_context)
        return ResidualUpdate(self._cross_attended(x, text_kv, image_kv, attend, compute_dtype,
                                                   codes, pending), None)

    def _query_takes_codes(self, x) -> bool:
        return self.norm3 is not None and takes_row_codes((self.cross_attn.q,), x)

    def _cross_attended(self, part, text_kv, image_kv, attend, compute_dtype, codes, pending):
        """The cross-attention output of the rows `part` of x, `pending` (an update owed to those
        rows, or None) added to them first: in the pass of the norm's codes where `codes`, else
        in a pass of its own."""
        if pending is not None and not codes:
            add_gated_(part, *pending)
            pending = None
        if self.norm3 is None:
            h = part.to(compute_dtype)
        elif codes:
            h = norm_codes(part, self.eps, compute_dtype, norm=self.norm3, pending=pending)
        else:
            h = norm_affine(part, self.norm3, self.eps, compute_dtype)
        return self.cross_attn.attend_rows(h, text_kv, image_kv, attend)

    def feed_forward_phase(self, x, e0, compute_dtype):
        """The FFN added to x (in place; returned), over row chunks (ffn_chunks)."""
        update = self.feed_forward_update(x, e0, compute_dtype)
        if update is not None:
            add_gated_(x, *update)
        return x

    def feed_forward_update(self, x, e0, compute_dtype,
                            pending: ResidualUpdate | None = None) -> ResidualUpdate | None:
        """The FFN of a one-chunk x returned as x's update, not added; over several chunks
        (ffn_chunks) each chunk's output is added to x as it is made, and None returned.
        `pending` (the cross-attention's update, where feed_forward_takes_update) is added to x
        in the pass of the norm's codes, and the hidden activation is made in
        HIDDEN_PIECES_WITH_UPDATE row pieces."""
        shift_ff, scale_ff, gate_ff = self._modulated(e0)[3:]
        length = x.shape[1]
        chunks = self._ffn_chunks(x, e0, compute_dtype)
        layers = self._ffn_code_layers()
        if pending is not None and len(chunks) != 1:
            raise ValueError("feed_forward_update: an owed update needs the FFN in one chunk")
        if len(chunks) == 1:
            h = self._normed(x, 0, length, shift_ff, scale_ff, compute_dtype, layers, pending)
            pieces = 1 if pending is None else HIDDEN_PIECES_WITH_UPDATE
            return ResidualUpdate(feed_forward(self.ffn, h, pieces), gate_ff)
        for start, end in chunks:
            out = feed_forward(self.ffn, self._normed(x, start, end, shift_ff, scale_ff,
                                                      compute_dtype, layers))
            add_gated_(x[:, start:end], out, group_rows(gate_ff, start, end, length))
        return None

    def feed_forward_takes_update(self, x, e0, compute_dtype) -> bool:
        """Whether feed_forward_update takes the cross-attention's update (`pending`) into its
        norm's pass: where both FFN layers take fp8 codes and the FFN runs in one chunk. The
        update then stays alive through the FFN; its hidden activation in pieces more than
        makes up for it (5B 720p: 0.17 GB held, 0.39 GB of the first product's output fewer)."""
        layers = self._ffn_code_layers()
        return (len(self._ffn_chunks(x, e0, compute_dtype)) == 1 and bool(layers)
                and takes_row_codes((*layers, self.ffn[2]), x))

    def _ffn_code_layers(self) -> tuple[nn.Module, ...]:
        """The FFN layers that may take its norm's codes: the first, where the second takes the
        GELU's codes (feed_forward); none otherwise."""
        return (self.ffn[0],) if getattr(self.ffn[2], "gelu_forward", None) is not None else ()

    def _ffn_chunks(self, x, e0, compute_dtype) -> list[tuple[int, int]]:
        return ffn_chunks(x.shape[1], e0.shape[1], self.ffn[0].out_features,
                          hidden_bytes(self.ffn[0], compute_dtype))

    def _chunked_keys_values(self, x, chunks, normed, shift, scale, rope, compute_dtype,
                             hold: bool = False):
        """Self-attention keys and values of all rows, made chunk by chunk into buffers, and
        with `hold` each chunk's normed input (for q, k and v alike) in a list, in chunk order
        (else the list is empty)."""
        attn = self.self_attn
        batch, length, dim = x.shape
        heads = (batch, length, attn.num_heads, dim // attn.num_heads)
        k = x.new_empty(heads, dtype=compute_dtype)
        v = x.new_empty(heads, dtype=compute_dtype)
        layers = (attn.q, attn.k, attn.v) if hold else (attn.k, attn.v)
        held = []
        for start, end in chunks:
            h = normed(start, end, shift, scale, layers)
            k[:, start:end], v[:, start:end] = attn.keys_values(h, rope, start)
            if hold:
                held.append(h)
        return k, v, held


def _add_update(rows: torch.Tensor, update: ResidualUpdate) -> None:
    add_gated_(rows, *update)


def after_opaque(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """layer(x) for an x that an attention kernel made: a layer that quantizes its input (fp8
    matmuls) then does so in a kernel of its own inside compiled graphs too, since there is no
    step before it that the compiler could fuse the quantization into
    (Fp8Linear.forward_after_opaque)."""
    forward = getattr(layer, "forward_after_opaque", None)
    return layer(x) if forward is None else forward(x)


def _self_attend(attend):
    # over several processes (distributed/sequence_split.py) self-attention spans them all
    return getattr(attend, "self_attention", attend)


def feed_forward(ffn: nn.Sequential, h: torch.Tensor | RowCodes, pieces: int = 1
                 ) -> torch.Tensor:
    """Linear, tanh-GELU, linear. A second layer that can take the GELU into its input step
    (fp8 matmuls: quant/linear.py gelu_forward) does, and then takes the first layer's bias
    too when the first one runs an fp8 matmul; otherwise a plain 16-bit first layer on a GPU
    takes the GELU into its product's epilogue (glue.linear_gelu), also with its LoRA terms
    summed into the weight for the call. `pieces` > 1: where both layers run fp8 matmuls, the
    first layer's output exists for one of that many row pieces at a time (hidden_codes), the
    same numbers."""
    first, act, second = ffn
    gelu_forward = getattr(second, "gelu_forward", None)
    if gelu_forward is None:
        weights = gelu_product_weights(first, act, h)
        if weights is not None:
            return second(linear_gelu(h, *weights))
        return second(act(first(h)))
    fp8_first = getattr(first, "runs_fp8_matmul", None)
    # a norm's codes (RowCodes) come only to a first layer that runs the fp8 matmul
    if fp8_first is not None and (isinstance(h, RowCodes) or fp8_first(h.device)):
        if pieces > 1 and second.runs_fp8_matmul(_device(h)):
            return second(hidden_codes(first, h, pieces))
        return gelu_forward(first.scaled_forward_without_bias(h), first.bias)
    return gelu_forward(first(h))


# pieces of the hidden activation of an FFN handed the cross-attention's update (see
# WanBlock.feed_forward_takes_update)
HIDDEN_PIECES_WITH_UPDATE = 2


def hidden_codes(first: nn.Module, h: torch.Tensor | RowCodes, pieces: int) -> RowCodes:
    """The fp8 codes of gelu_tanh(first(h)), the input of an fp8 second layer, made `pieces`
    row ranges at a time: first's product of each range (without its bias), then its GELU and
    codes into rows of one codes tensor (quant/gelu_fp8.py gelu_quantize_in_pieces); each row
    is the whole product's row, so the codes are gelu_forward's to the bit. A LoRA'd first
    layer that sums its terms into its weight per call (lora/layers.py) does so once for all
    the pieces (products_without_bias)."""
    rows = math.prod(h.shape[:-1])
    step = -(-rows // pieces)
    piece_product = first.products_without_bias(rows)

    def product(start: int, end: int) -> torch.Tensor:
        return piece_product(_row_range(h, start, end))

    codes, scales = gelu_quantize_in_pieces(
        product, rows, first.out_features, first.bias,
        [(start, min(start + step, rows)) for start in range(0, rows, step)], _device(h))
    return RowCodes(codes, scales, (*h.shape[:-1], first.out_features), h.dtype)


def _row_range(h: torch.Tensor | RowCodes, start: int, end: int) -> torch.Tensor | RowCodes:
    """Rows start..end of h's rows (all leading dimensions flattened)."""
    if isinstance(h, RowCodes):
        return RowCodes(h.codes[start:end], h.scales[start:end], (end - start, h.shape[-1]),
                        h.dtype)
    return h.reshape(-1, h.shape[-1])[start:end]


def _device(h: torch.Tensor | RowCodes) -> torch.device:
    return h.codes.device if isinstance(h, RowCodes) else h.device


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
                sequence=None) -> torch.Tensor:
        """Velocity prediction, float32, shaped like x.

        x: [B, C, F, H, W] noisy latent; y: optional conditioning channels concatenated to x
        (image-to-video); t: timesteps on the 0..1000 scale, taken as given (never rounded);
        context: [B, L, 4096] umT5 rows; clip_tokens: [B, 257, 1280] for Wan2.1 I2V.
        `blocks` lets an offloader supply the blocks as they become resident (default: self.blocks).
        compiled: run the blocks through torch.compile (wan/compiled_blocks.py).
        between_blocks(): called before every block; the caller's interrupt check raises there.
        sequence: this process computes one shard of the token rows, the others of its process
        group the rest (distributed/sequence_split.py SequenceSplit); the output is whole.
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

        compiled_forward = compiled_block_forward() if compiled else None
        # compiled blocks take the attention phases in one pass: unrolled over row chunks, the
        # compiled graph ran slower and kept more alive (14B 720p, H100: 12.2 s and 16.7 GiB of
        # activations against 11.3 s and 5.8 GiB); the FFN stays chunked either way
        attention_rows = tokens.shape[1] if compiled else None
        if sequence is not None:  # the attention phases in one pass: one exchange per block
            tokens, e, e0, rope, attend = sequence.shard(tokens, grid, e, e0, rope, attend,
                                                         self.config.num_heads)
            attention_rows = tokens.shape[1]
        owed = OwedUpdate() if compiled else None  # the last FFN's update, added by the next block
        for block in (self.blocks if blocks is None else blocks):
            between_blocks()
            args = (tokens, e0, rope, text, image, attend, self.compute_dtype, attention_rows)
            tokens = compiled_forward(block, *args, owed=owed) if compiled else block(*args)
        if owed is not None and owed.update is not None:
            add_gated_(tokens, *owed.take())

        out = self.head(tokens, e)
        if sequence is not None:
            out = sequence.gather(out)
        return self.unpatchify(out, grid)


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
