"""Exact attention for Hopper GPUs (compute capability 9.0) in bf16 or fp16, in Triton's Gluon
dialect: flash attention (Q K^T and P V on the tensor cores in the input's 16-bit type, float32
accumulation, the online softmax in float32) with the work split between warps the way
Hopper's asynchronous tensor cores want it. The structure is fp8_attention_hopper's:
- a producer warp loads each block of 128 keys and values once, by TMA, into a ring of STAGES
  shared-memory buffers, signalled by mbarriers;
- two consumer warp groups (64 query rows each) share every block and take turns on the tensor
  cores, so one group's softmax runs while the other multiplies;
- within a turn a group issues block j + 1's Q K^T and block j's P V (accumulated in place) and
  waits only for the scores; nothing is in flight across a loop iteration.

Q, K, V are read straight from the callers' contiguous [B, L, heads, head_dim] tensors (as two-
dimensional [B * L, heads * head_dim] for TMA; rows past a batch's end are masked). Needs more
than one block of keys (L > 128): bf16_attention.py sends shorter ones to SDPA.
"""

from __future__ import annotations

import math

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    mbarrier, warpgroup_mma, warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from ..gpu_support import KERNEL_OPTIONS
from .gluon_hopper import tma_load

BLOCK_N = 128  # keys per block
BLOCK_M = 64  # query rows per consumer group (one wgmma row tile); a program takes 128
ROWS_PER_PROGRAM = 2 * BLOCK_M  # query rows a program takes (its two groups')
STAGES = 3  # key/value buffers, 64 KiB each in 16 bits (2 were much slower on the H100)
CONSUMER_REGS = 240
MAX_REGS = 168  # per thread at launch: 12 warps (4 + 4 + the producer's group) x 32 x 168 fit
# how the launch builds it, but for gpu_support.KERNEL_OPTIONS (kernel_probe builds it alike)
BUILD_OPTIONS = {"num_warps": 4, "maxnreg": MAX_REGS}
HEAD_DIM = 128
LOG2E = 1.4426950408889634
_GL_TYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}


@gluon.jit
def _softmax(s, m_i, l_i, score_scale, start_n, L, BLOCK_N: gl.constexpr, MASK: gl.constexpr,
             s_layout: gl.constexpr):
    """One block's online softmax (base 2; score_scale = log2(e) / sqrt(head_dim))."""
    if MASK:
        offs_n = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        s = gl.where(offs_n[None, :] < L, s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, 1) * score_scale)
    p = gl.exp2(s * score_scale - m_new[:, None])
    alpha = gl.exp2(m_i - m_new)
    l_i = l_i * alpha + gl.sum(p, 1)
    return p, alpha, l_i, m_new


@gluon.jit
def _block(j, p, q, k_smem, v_smem, ready, empty, mine, other, t_phase, acc, l_i, m_i,
           score_scale, L, zero_s, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
           MASK: gl.constexpr, s_layout: gl.constexpr, o_layout: gl.constexpr,
           p_layout: gl.constexpr):
    """Block j's P V (into acc) and block j + 1's scores and softmax; acc leaves rescaled to
    block j + 1's running maximum."""
    pv_in = gl.convert_layout(p.to(q.dtype), p_layout)
    st = (j + 1) % STAGES
    mbarrier.wait(mine, t_phase)
    mbarrier.wait(ready.index(st), ((j + 1) // STAGES) & 1)
    s_tok = warpgroup_mma(q, k_smem.index(st).permute((1, 0)), zero_s, use_acc=False,
                          is_async=True)
    acc_tok = warpgroup_mma(pv_in, v_smem.index(j % STAGES), acc, is_async=True)
    mbarrier.arrive(other, count=1)  # the other group's turn
    s = warpgroup_mma_wait(1, deps=(s_tok, ))
    p, alpha, l_i, m_i = _softmax(s, m_i, l_i, score_scale, (j + 1) * BLOCK_N, L, BLOCK_N, MASK,
                                  s_layout)
    acc = warpgroup_mma_wait(0, deps=(acc_tok, ))
    mbarrier.arrive(empty.index(j % STAGES), count=1)  # block j's keys and values are read
    acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
    return p, acc, l_i, m_i, t_phase ^ 1


@gluon.jit
def _producer(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, ready, empty, turn, o_ptr,
              score_scale, L, LQ, H, stride_ob, stride_ol, stride_oh, D: gl.constexpr,
              BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
              GROUP: gl.constexpr):
    """Both groups' query rows, then every block of keys and values once a buffer is free (both
    groups have read what it held)."""
    bh = gl.program_id(1)
    b = bh // H
    col = (bh % H) * D
    q_row = b * LQ + gl.program_id(0) * (2 * BLOCK_M)
    mbarrier.expect(q_bar, 2 * q_desc.block_type.nbytes)
    tma_load(q_desc, [q_row, col], q_bar, q_smem.index(0))
    tma_load(q_desc, [q_row + BLOCK_M, col], q_bar, q_smem.index(1))
    for j in range((L + BLOCK_N - 1) // BLOCK_N):
        st = j % STAGES
        mbarrier.wait(empty.index(st), ((j // STAGES) & 1) ^ 1)
        bar = ready.index(st)
        mbarrier.expect(bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
        tma_load(k_desc, [b * L + j * BLOCK_N, col], bar, k_smem.index(st))
        tma_load(v_desc, [b * L + j * BLOCK_N, col], bar, v_smem.index(st))


@gluon.jit
def _consumer(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, ready, empty, turn, o_ptr,
              score_scale, L, LQ, H, stride_ob, stride_ol, stride_oh, D: gl.constexpr,
              BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
              GROUP: gl.constexpr):
    """One group's 64 query rows over all keys, written to the output."""
    bh = gl.program_id(1)
    n = (L + BLOCK_N - 1) // BLOCK_N
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, D, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    # turn[g] completes a phase each time the other group has issued its products; group 0 goes
    # first (its first wait passes on the barrier's initial phase)
    mine = turn.index(GROUP)
    other = turn.index(1 - GROUP)
    t_phase = 1 - GROUP
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
    l_i = gl.full([BLOCK_M], 0.0, gl.float32, gl.SliceLayout(1, s_layout))
    acc = gl.zeros([BLOCK_M, D], gl.float32, o_layout)
    zero_s = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    q = q_smem.index(GROUP)
    mbarrier.wait(q_bar, 0)

    # block 0's scores alone, its softmax (block 0 is whole: L > BLOCK_N)
    mbarrier.wait(mine, t_phase)
    t_phase ^= 1
    mbarrier.wait(ready.index(0), 0)
    s = warpgroup_mma(q, k_smem.index(0).permute((1, 0)), zero_s, use_acc=False, is_async=True)
    mbarrier.arrive(other, count=1)
    s = warpgroup_mma_wait(0, deps=(s, ))
    p, alpha, l_i, m_i = _softmax(s, m_i, l_i, score_scale, 0, L, BLOCK_N, False, s_layout)
    for j in range(0, n - 2):
        p, acc, l_i, m_i, t_phase = _block(
            j, p, q, k_smem, v_smem, ready, empty, mine, other, t_phase, acc, l_i, m_i,
            score_scale, L, zero_s, BLOCK_N, STAGES, False, s_layout, o_layout, p_layout)
    # the last block's scores are masked past L
    p, acc, l_i, m_i, t_phase = _block(
        n - 2, p, q, k_smem, v_smem, ready, empty, mine, other, t_phase, acc, l_i, m_i,
        score_scale, L, zero_s, BLOCK_N, STAGES, True, s_layout, o_layout, p_layout)
    # and its P V alone
    pv_in = gl.convert_layout(p.to(q.dtype), p_layout)
    mbarrier.wait(mine, t_phase)
    acc = warpgroup_mma(pv_in, v_smem.index((n - 1) % STAGES), acc, is_async=True)
    mbarrier.arrive(other, count=1)
    acc = warpgroup_mma_wait(0, deps=(acc, ))
    mbarrier.arrive(empty.index((n - 1) % STAGES), count=1)

    offs_d = gl.arange(0, D, layout=gl.SliceLayout(0, o_layout))
    l_o = gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))
    out = acc / l_o[:, None]
    rows = gl.program_id(0) * (2 * BLOCK_M) + GROUP * BLOCK_M + gl.arange(
        0, BLOCK_M, layout=gl.SliceLayout(1, o_layout))
    o = o_ptr + (bh // H).to(gl.int64) * stride_ob + (bh % H) * stride_oh
    gl.store(o + rows[:, None] * stride_ol + offs_d[None, :], out.to(o_ptr.dtype.element_ty),
             mask=rows[:, None] < LQ)


@gluon.jit
def hopper_bf16_attention_kernel(q_desc, k_desc, v_desc, o_ptr, score_scale, L, LQ, H, stride_ob,
                                 stride_ol, stride_oh, D: gl.constexpr, BLOCK_M: gl.constexpr,
                                 BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                                 CONSUMER_REGS: gl.constexpr, num_warps: gl.constexpr):
    dtype: gl.constexpr = q_desc.dtype
    q_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_M, D], q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D], v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)  # both consumer groups release a buffer
    for i in gl.static_range(2):
        mbarrier.init(turn.index(i), count=1)
    # every partition takes the same arguments (GROUP last)
    gl.warp_specialize([
        (_consumer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, ready, empty, turn,
                     o_ptr, score_scale, L, LQ, H, stride_ob, stride_ol, stride_oh, D, BLOCK_M,
                     BLOCK_N, STAGES, 0)),
        (_consumer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, ready, empty, turn,
                     o_ptr, score_scale, L, LQ, H, stride_ob, stride_ol, stride_oh, D, BLOCK_M,
                     BLOCK_N, STAGES, 1)),
        (_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, ready, empty, turn,
                     o_ptr, score_scale, L, LQ, H, stride_ob, stride_ol, stride_oh, D, BLOCK_M,
                     BLOCK_N, STAGES, 0)),
    ], [4, 1], [CONSUMER_REGS, 24])


def _descriptor(t: torch.Tensor, block: list[int]) -> TensorDescriptor:
    layout = gl.NVMMASharedLayout.get_default_for(block, _GL_TYPES[t.dtype])
    return TensorDescriptor.from_tensor(t, block, layout)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
           stages: int = STAGES) -> None:
    """Attention of q [B, Lq, heads, 128] over k, v [B, L, heads, 128] (contiguous, bf16 or
    fp16, L > 128) written into out (the same layout as q, last dimension contiguous)."""
    b, lq, heads, dim = q.shape
    length = k.shape[1]
    q_desc = _descriptor(q.view(b * lq, heads * dim), [BLOCK_M, dim])
    k_desc = _descriptor(k.view(b * length, heads * dim), [BLOCK_N, dim])
    v_desc = _descriptor(v.view(b * length, heads * dim), [BLOCK_N, dim])
    hopper_bf16_attention_kernel[(-(-lq // ROWS_PER_PROGRAM), b * heads)](
        q_desc, k_desc, v_desc, out, LOG2E / math.sqrt(dim), length, lq, heads,
        *out.stride()[:3], D=dim, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, STAGES=stages,
        CONSUMER_REGS=CONSUMER_REGS, **BUILD_OPTIONS, **KERNEL_OPTIONS)
