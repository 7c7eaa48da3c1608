"""One Wan DiT block (WanBlock) as three phases (self-attention, cross-attention, feed-forward)
over row chunks (wan/chunks.py), each adding its update to the float32 residual stream in
place, or handing it to the next phase's norm pass (the compiled blocks: wan/compiled_blocks.py).
Parameter names equal the official checkpoint keys."""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn as nn

from .attention import wave_rows
from .chunks import checked, ffn_chunks, group_rows, hidden_bytes, row_chunks
from .configs import DiTConfig
from .dit_attention import CrossAttention, SelfAttention
from .dit_ffn import feed_forward
from .fp8_attention import fp8_attention, fp8_keys
from .glue import add_gated_, norm_affine, norm_codes, norm_modulate, takes_row_codes

# An eager self-attention phase of at most this many row chunks holds every chunk's norm codes
# (1 byte a value) from its keys' and values' pass until its queries take them, instead of a
# second norm pass per chunk: all of them together are then at most what one chunk's queries and
# attention output take (bf16: 4 bytes a value of one chunk). Measured: faster at 5B and 1.3B
# (4 chunks) with the same peaks; over 14B's chunks the held codes raised the peak
# (bench/results/2026-11-26-h100-eager-held-codes/).
HELD_CODE_CHUNKS = 4

# pieces of the hidden activation of an FFN handed the cross-attention's update (see
# WanBlock.feed_forward_takes_update)
HIDDEN_PIECES_WITH_UPDATE = 2


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
        for start, end in checked(chunks):
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
        for start, end in checked(chunks):
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
        for start, end in checked(chunks):
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
        for start, end in checked(chunks):
            h = normed(start, end, shift, scale, layers)
            k[:, start:end], v[:, start:end] = attn.keys_values(h, rope, start)
            if hold:
                held.append(h)
        return k, v, held


def _add_update(rows: torch.Tensor, update: ResidualUpdate) -> None:
    add_gated_(rows, *update)


def _self_attend(attend):
    # over several processes (distributed/sequence_split.py) self-attention spans them all
    return getattr(attend, "self_attention", attend)
