"""Triton kernels of the FP8 attention backend (see fp8_attention.py for the numerics).

Imported only where Triton is installed. Layouts (bh = batch * heads + head):
  q8  int8 [BH, LQp, D]      one scale per token (qs [BH, LQp], with softmax scale * log2(e));
                             the queries may be fewer than the keys (a chunk of rows)
  k8  int8 [BH, Lp, D]       the keys minus their mean over tokens, one scale per K_BLOCK
                             tokens (ks [BH, Lp / K_BLOCK])
  vt  fp8 e4m3 [BH, D, Lp]   values transposed (the layout fp8 tensor-core products take for
                             the P x V operand), one scale per channel (vs [BH, D]); the keys
                             of each 32 in the operand order (key_order; bf16 vt: in order)
Lp (LQp) is L (LQ) rounded up to K_BLOCK; the rows (columns of vt) past L are zeros. The output
is written straight into the caller's [B, LQ, H, D] layout.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .glue_kernels import rms_norm_rope_heads

FP8_MAX = tl.constexpr(448.0)  # the largest finite float8_e4m3fn
INT8_MAX = tl.constexpr(127.0)
K_BLOCK = tl.constexpr(128)  # tokens per key scale, and the autotuned configurations' BLOCK_N
# probabilities (0..1) are multiplied by 448 (= 2^P_LOG2) before their fp8 cast
P_LOG2 = tl.constexpr(8.807354922057604)


@triton.jit
def key_order(x):
    """x [rows, n] (n a multiple of 32) with each 32 columns in the P V operand's order: column
    16h + 4q + 2a + b takes column 16h + 8a + 2q + b. The scores' accumulator gives a thread the
    columns 2q, 2q + 1, 8 + 2q, 9 + 2q (and 16 more) of each 32; the fp8 operand wants a thread's
    four bytes to be adjacent keys. With P's columns and V's keys in this order, P becomes the
    operand in the registers that hold it (no shuffles); P V is the same sum over keys."""
    rows: tl.constexpr = x.shape[0]
    cols: tl.constexpr = x.shape[1]
    x = tl.reshape(x, [rows, cols // 32, 2, 2, 4, 2])
    return tl.reshape(tl.permute(x, (0, 1, 2, 4, 3, 5)), [rows, cols])


@triton.jit
def _round_int8(x):
    """Round half away from zero (|x| <= 127 by construction) to int8."""
    return tl.where(x >= 0, x + 0.5, x - 0.5).to(tl.int32).to(tl.int8)


@triton.jit
def _head_block(x_ptr, L, H, stride_b, stride_l, stride_h, BLOCK: tl.constexpr,
                D: tl.constexpr):
    """This program's block of BLOCK tokens of one head of x [B, L, H, D] (rows past L read as
    zeros), in float32, with its program id, batch-head index, row and channel indices."""
    pid = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    rows = pid * BLOCK + tl.arange(0, BLOCK)
    cols = tl.arange(0, D)
    x = tl.load(x_ptr + b * stride_b + h * stride_h + rows[:, None] * stride_l + cols[None, :],
                mask=rows[:, None] < L, other=0.0).to(tl.float32)
    return pid, bh, rows, cols, x


@triton.jit
def quantize_q_kernel(x_ptr, out_ptr, scale_ptr, L, Lp, H, stride_b, stride_l, stride_h,
                      score_scale, BLOCK: tl.constexpr, D: tl.constexpr):
    """int8 codes, one scale per token: its largest magnitude over the head's channels / 127."""
    pid, bh, rows, cols, x = _head_block(x_ptr, L, H, stride_b, stride_l, stride_h, BLOCK, D)
    scale = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-30) / INT8_MAX
    codes = _round_int8(x / scale[:, None])
    keep = rows < Lp
    tl.store(out_ptr + bh.to(tl.int64) * Lp * D + rows[:, None] * D + cols[None, :], codes,
             mask=keep[:, None])
    tl.store(scale_ptr + bh.to(tl.int64) * Lp + rows, scale * score_scale, mask=keep)


@triton.jit
def _query_codes_part(y, FIRST: tl.constexpr, HEADS: tl.constexpr, row, L, H, Lp, out_ptr,
                      scale_ptr, score_scale, D: tl.constexpr):
    """A part's heads [HEADS, D] of the normed, rotated row (float32), rounded to bf16 as
    rms_norm_rope_kernel stores them, in int8 codes with one scale per head (quantize_q_kernel's
    numbers), stored at the row's token of each head."""
    y = y.to(tl.bfloat16).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(y), axis=1), 1e-30) / INT8_MAX
    codes = _round_int8(y / scale[:, None])
    head = FIRST + tl.arange(0, HEADS)
    bh = (row // L).to(tl.int64) * H + head
    token = row % L
    keep = head < H
    tl.store(out_ptr + ((bh * Lp + token) * D)[:, None] + tl.arange(0, D)[None, :], codes,
             mask=keep[:, None])
    tl.store(scale_ptr + bh * Lp + token, scale * score_scale, mask=keep)


@triton.jit
def normed_query_kernel(x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, scale_ptr, W, eps, L,
                        rope_start, H, Lp, score_scale, HEADS0: tl.constexpr,
                        HEADS1: tl.constexpr, D: tl.constexpr):
    """The queries' RMS norm and rotation (glue_kernels.rms_norm_rope_kernel's row of x [B*L, W],
    the same arithmetic in the same layout, rounded to bf16 as that kernel stores it) and their
    int8 codes (quantize_q_kernel's numbers) in one pass: q never goes to memory in bf16. One
    program per token, all its heads."""
    row = tl.program_id(0)
    y0, offs0, y1, offs1, base = rms_norm_rope_heads(
        x_ptr, w_ptr, cos_ptr, sin_ptr, row, W, eps, L, rope_start, True, HEADS0, HEADS1, D)
    _query_codes_part(y0, 0, HEADS0, row, L, H, Lp, out_ptr, scale_ptr, score_scale, D)
    _query_codes_part(y1, HEADS0, HEADS1, row, L, H, Lp, out_ptr, scale_ptr, score_scale, D)


@triton.jit
def quantize_k_kernel(x_ptr, mean_ptr, out_ptr, scale_ptr, L, Lp, H, stride_b, stride_l,
                      stride_h, BLOCK: tl.constexpr, D: tl.constexpr):
    """Keys minus their per-channel mean in int8 codes, one scale per BLOCK tokens."""
    pid, bh, rows, cols, x = _head_block(x_ptr, L, H, stride_b, stride_l, stride_h, BLOCK, D)
    mean = tl.load(mean_ptr + bh.to(tl.int64) * D + cols)
    x = tl.where(rows[:, None] < L, x - mean[None, :], 0.0)
    scale = tl.maximum(tl.max(tl.max(tl.abs(x), axis=1), axis=0), 1e-30) / INT8_MAX
    codes = _round_int8(x / scale)
    tl.store(out_ptr + bh.to(tl.int64) * Lp * D + rows[:, None] * D + cols[None, :], codes)
    tl.store(scale_ptr + bh.to(tl.int64) * (Lp // BLOCK) + pid, scale)


@triton.jit
def quantize_vt_kernel(x_ptr, scale_ptr, out_ptr, L, Lp, H, stride_b, stride_l, stride_h,
                       BLOCK: tl.constexpr, D: tl.constexpr):
    """Values divided by their channel scale, written transposed [D, Lp] in out's dtype (fp8,
    each 32 keys in key_order; bf16 in order, with scales of 1, for the bf16 P V product)."""
    pid, bh, rows, cols, x = _head_block(x_ptr, L, H, stride_b, stride_l, stride_h, BLOCK, D)
    scale = tl.load(scale_ptr + bh.to(tl.int64) * D + cols)
    codes = tl.trans((x / scale[None, :]).to(out_ptr.dtype.element_ty))
    if out_ptr.dtype.element_ty == tl.float8e4nv:
        codes = key_order(codes)
    tl.store(out_ptr + bh.to(tl.int64) * D * Lp + cols[:, None] * Lp + rows[None, :], codes)


# int32 scores to float32 without a conversion instruction: |score| <= 127 * 127 * 128 < 2^22, so
# the bits of MAGIC_I + score read as a float are MAGIC_F + score exactly (1.5 * 2^23 + score)
MAGIC_I = tl.constexpr(0x4B400000)
MAGIC_F = tl.constexpr(12582912.0)


@triton.jit
def _attend_block(acc, l_i, m_i, q, qs, k_base, vt_base, ks_base, start_n, L, Lp,
                  BLOCK_N: tl.constexpr, D: tl.constexpr, KB: tl.constexpr,
                  MASK: tl.constexpr, PV_FP8: tl.constexpr):
    """One block of keys: int32 scores, online softmax in float32, P V accumulated into acc.

    Per score the work is one integer add, one fused multiply-add and one exp2 (the special
    function unit does the exp2 alone: the integer scores become floats by their bits, see
    MAGIC_I). The row maximum is taken over the integer scores (their scale is positive, so the
    order is the same), and P's fp8 scale (448) is an offset of the exponent, not a product (it
    cancels in l_i)."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    k = tl.load(k_base + offs_n[:, None] * D + offs_d[None, :])
    scale = qs * tl.load(ks_base + start_n // KB)
    scores = tl.dot(q, tl.trans(k))
    if MASK:
        scores = tl.where(offs_n[None, :] < L, scores, -2147483647)
    m_new = tl.maximum(m_i, tl.max(scores, 1).to(tl.float32) * scale)
    shift = m_new
    if PV_FP8:
        shift = m_new - P_LOG2
    # (MAGIC_F + s) * scale - (MAGIC_F * scale + shift): the bias is rounded once per row and
    # block (a shift of the block's probabilities by under 1e-4 of a binade)
    as_float = (scores + MAGIC_I).to(tl.float32, bitcast=True)
    bias = MAGIC_F * scale + shift
    p = tl.math.exp2(as_float * scale[:, None] - bias[:, None])
    if MASK:
        p = tl.where(offs_n[None, :] < L, p, 0.0)
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    vt = tl.load(vt_base + offs_d[:, None] * Lp + offs_n[None, :])
    # each block's product is summed into acc in float32 registers, not accumulated by the
    # tensor cores: Hopper's fp8 products accumulate with fewer bits than float32, and over
    # tens of thousands of keys the output of values with a large mean drifts (a GPU test);
    # centring the values first does not save it (bench/results/README.md, experiments)
    if PV_FP8:  # vt's keys are in key_order
        pv = tl.dot(key_order(p.to(tl.float8e4nv)), tl.trans(vt))
    else:
        pv = tl.dot(p.to(vt.dtype), tl.trans(vt))
    acc = acc * alpha[:, None] + pv
    return acc, l_i, m_new


def attention_configs():
    """The configurations the autotuner tries (the H100's best at Wan's shapes first; 4 stages,
    64x64 and 256-key blocks were slower there: bench/results/). All take K_BLOCK keys per
    block: the online softmax's running maximum, and so P's fp8 rounding, changes per block, so
    a 64-key configuration computes other bits, and the output would depend on which
    configuration the autotuner's timing picked in this process."""
    configs = []
    for block_m, block_n, warps, stages in ((64, 128, 4, 3), (128, 128, 8, 3), (64, 128, 4, 2)):
        configs.append(triton.Config({"BLOCK_M": block_m, "BLOCK_N": block_n},
                                     num_warps=warps, num_stages=stages))
    return configs


@triton.autotune(configs=attention_configs(), key=["L", "LQ", "D", "PV_FP8"])
@triton.jit
def attention_kernel(q_ptr, k_ptr, vt_ptr, qs_ptr, ks_ptr, vs_ptr, o_ptr, L, Lp, LQ, LQp, H,
                     stride_ob, stride_ol, stride_oh, D: tl.constexpr, KB: tl.constexpr,
                     PV_FP8: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    bh64 = bh.to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    q = tl.load(q_ptr + bh64 * LQp * D + offs_m[:, None] * D + offs_d[None, :],
                mask=offs_m[:, None] < LQp, other=0.0)
    qs = tl.load(qs_ptr + bh64 * LQp + offs_m, mask=offs_m < LQp, other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    k_base = k_ptr + bh64 * Lp * D
    vt_base = vt_ptr + bh64 * D * Lp
    ks_base = ks_ptr + bh64 * (Lp // KB)
    full = L - L % BLOCK_N
    for start_n in range(0, full, BLOCK_N):
        acc, l_i, m_i = _attend_block(acc, l_i, m_i, q, qs, k_base, vt_base, ks_base, start_n,
                                      L, Lp, BLOCK_N, D, KB, False, PV_FP8)
    if full < L:
        acc, l_i, m_i = _attend_block(acc, l_i, m_i, q, qs, k_base, vt_base, ks_base, full,
                                      L, Lp, BLOCK_N, D, KB, True, PV_FP8)
    if PV_FP8:  # acc and l_i both carry P's factor 448
        vs = tl.load(vs_ptr + bh64 * D + offs_d)
        out = acc * vs[None, :] / l_i[:, None]
    else:
        out = acc / l_i[:, None]
    o = o_ptr + b.to(tl.int64) * stride_ob + h * stride_oh
    tl.store(o + offs_m[:, None] * stride_ol + offs_d[None, :], out.to(o_ptr.dtype.element_ty),
             mask=offs_m[:, None] < LQ)
