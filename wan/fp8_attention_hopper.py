"""The fp8 attention kernel for Hopper GPUs (compute capability 9.0), in Triton's Gluon dialect:
the numerics of fp8_attention_kernels.attention_kernel (its output is bitwise the same), with the
work split between warps the way Hopper's asynchronous tensor cores want it.

Imported only where Triton has Gluon (fp8_attention.py decides). One program takes 192 query rows
of one head:
- a producer (the default partition; one of its threads issues every copy) loads the rows and
  then each block of 128 keys and values once, by TMA (the bulk copy engine), into a ring of
  STAGES shared-memory buffers, signalled by mbarriers;
- three consumer warp groups (64 query rows each) share every block. Per block a group stores
  its P in fp8 to its own shared-memory buffer, takes its turn to issue P V (the turns, three
  mbarriers, go round the groups so their products reach the tensor cores in order), waits for
  it and adds it into its float32 accumulator, then issues the next block's Q K^T and runs that
  block's softmax while the other groups multiply. Three groups keep three warps' softmax on
  each scheduler where two left it with one (Nsight Compute: issue slots 45% busy, a lone warp's
  dependent exponentials); their registers (160 a thread, the accumulator and the scores
  mostly) leave no room for P as a register operand, hence the shared buffer;
- P's columns are stored in the order of V's keys (fp8_attention_kernels.key_order): the values
  are stored so, and the product sums over keys in any order;
- whether a group stores P right after its softmax or when it next multiplies, and the ptxas
  options, follow the Triton release that builds the kernel (gluon_hopper.py: each release's
  fastest measured build); the output is the same.

Operands as fp8_attention_kernels documents (q8, k8, vt, their scales; rows padded to 128).
Needs more than one block of keys (L > 128): fp8_attention.py sends shorter ones to the portable
kernel. The last program of a head reads query rows past the head's padded rows (the next
head's, or zeros past the tensor's end by TMA); their scales read as 0 and their output is not
stored.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, warpgroup_mma, warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

# the portable kernel's constants (the same numerics, bit for bit)
from ..gpu_support import KERNEL_OPTIONS
from .fp8_attention_kernels import K_BLOCK, MAGIC_F, MAGIC_I, P_LOG2, key_order
# where a consumer stores P: right after its softmax (True) or when it next multiplies (False),
# and ptxas's options for this kernel ("-O1", or None: its default); the same bits, but
# Triton releases allocate registers differently (gluon_hopper.py)
from .gluon_hopper import FP8_PTXAS_OPTIONS, tma_load
from .gluon_hopper import STORE_P_EARLY as P_EARLY

BLOCK_N = K_BLOCK.value  # keys per block: the key scales' block
BLOCK_M = 64  # query rows per consumer group (one warp group's tensor-core tile)
GROUPS = 3  # consumer groups: a program takes GROUPS * BLOCK_M query rows
ROWS_PER_PROGRAM = GROUPS * BLOCK_M  # query rows a program takes
STAGES = 3  # key/value buffers (2 and 4 were no faster on the H100: bench/results/)
CONSUMER_REGS = 160  # per consumer thread; the producer's 4 warps keep the rest (32)
MAX_REGS = 128  # per thread at launch: 16 warps x 32 x 128 fill the register file
# local memory (spilled registers) a thread may take, in 4-byte words (CompiledKernel.n_spills),
# before `auto` takes the portable kernel instead: a net for Triton releases that build this
# kernel worse than those measured. On the H100 (bench/results/2026-11-26-h100-triton-releases/):
# Triton 3.6 builds it with 16-20 at ~880 TFLOP/s; ptxas at -O3 built it with 26 on 3.8 (~760,
# the portable kernel's speed) and 74 on 3.9 (~415); as built now, 0-14 on 3.8 and 3.9.
SPILL_LIMIT_WORDS = 24
# how the launch builds it, but for gpu_support.KERNEL_OPTIONS (kernel_probe builds it alike)
BUILD_OPTIONS = {"num_warps": 4, "maxnreg": MAX_REGS,
                 **({"ptx_options": FP8_PTXAS_OPTIONS} if FP8_PTXAS_OPTIONS else {})}
HEAD_DIM = 128


@gluon.jit
def _softmax(s, m_i, l_i, qs, ks, start_n, L, BLOCK_N: gl.constexpr, MASK: gl.constexpr,
             s_layout: gl.constexpr):
    """One block's online softmax over int32 scores s, as fp8_attention_kernels._attend_block."""
    scale = qs * ks
    if MASK:
        offs_n = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        s = gl.where(offs_n[None, :] < L, s, -2147483647)
    m_new = gl.maximum(m_i, gl.max(s, 1).to(gl.float32) * scale)
    as_float = (s + MAGIC_I).to(gl.float32, bitcast=True)
    bias = MAGIC_F * scale + (m_new - P_LOG2)
    p = gl.exp2(as_float * scale[:, None] - bias[:, None])
    if MASK:
        p = gl.where(offs_n[None, :] < L, p, 0.0)
    alpha = gl.exp2(m_i - m_new)
    l_i = l_i * alpha + gl.sum(p, 1)
    return p, alpha, l_i, m_new


@gluon.jit
def _producer(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, p_smem, q_bar, ready, empty, turn,
              qs_ptr, ks_ptr, vs_ptr, o_ptr, L, Lp, LQ, LQp, H, stride_ob, stride_ol, stride_oh,
              D: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
              STAGES: gl.constexpr, GROUPS: gl.constexpr, P_EARLY: gl.constexpr,
              GROUP: gl.constexpr):
    """Every group's query rows, then every block of keys and values once a buffer is free (all
    groups have read what it held)."""
    bh = gl.program_id(1)
    q_row = bh * LQp + gl.program_id(0) * (GROUPS * BLOCK_M)
    mbarrier.expect(q_bar, GROUPS * q_desc.block_type.nbytes)
    for g in gl.static_range(GROUPS):
        tma_load(q_desc, [q_row + g * BLOCK_M, 0], q_bar, q_smem.index(g))
    for j in range((L + BLOCK_N - 1) // BLOCK_N):
        st = j % STAGES
        mbarrier.wait(empty.index(st), ((j // STAGES) & 1) ^ 1)
        bar = ready.index(st)
        mbarrier.expect(bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
        tma_load(k_desc, [bh * Lp + j * BLOCK_N, 0], bar, k_smem.index(st))
        tma_load(v_desc, [bh * D, j * BLOCK_N], bar, v_smem.index(st))


@gluon.jit
def _store_p(p, p_mine):
    """P in fp8 (its columns in V's key order) to this group's shared-memory buffer, visible to
    the tensor cores."""
    p_mine.store(key_order(p.to(gl.float8e4nv)))
    fence_async_shared()


@gluon.jit
def _pv(j, p, p_mine, v_smem, empty, mine, nxt, t_phase, acc, alpha_prev, zero_o,
        STAGES: gl.constexpr, P_EARLY: gl.constexpr):
    """Block j's P V added into acc: P stored (here, unless P_EARLY stored it after its
    softmax), the product issued in this group's turn and waited for, block j's keys and values
    released."""
    if not P_EARLY:
        _store_p(p, p_mine)
    mbarrier.wait(mine, t_phase)
    pv = warpgroup_mma(p_mine, v_smem.index(j % STAGES).permute((1, 0)), zero_o, use_acc=False,
                       is_async=True)
    mbarrier.arrive(nxt, count=1)
    pv = warpgroup_mma_wait(0, deps=(pv, ))
    mbarrier.arrive(empty.index(j % STAGES), count=1)
    # each block's product is summed in float32 registers (see fp8_attention_kernels)
    return acc * alpha_prev[:, None] + pv, t_phase ^ 1


@gluon.jit
def _scores(j, q, k_smem, ready, zero_s, STAGES: gl.constexpr):
    """Block j's Q K^T (int32), once its keys are in."""
    mbarrier.wait(ready.index(j % STAGES), (j // STAGES) & 1)
    s = warpgroup_mma(q, k_smem.index(j % STAGES).permute((1, 0)), zero_s, use_acc=False,
                      is_async=True)
    return warpgroup_mma_wait(0, deps=(s, ))


@gluon.jit
def _block(j, p, q, p_mine, k_smem, v_smem, ready, empty, mine, nxt, t_phase, acc, alpha_prev, l_i,
           m_i, qs, ks_base, L, zero_s, zero_o, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
           MASK: gl.constexpr, s_layout: gl.constexpr, o_layout: gl.constexpr,
           P_EARLY: gl.constexpr):
    """Block j's P V, then block j + 1's scores and softmax (p: block j's probabilities)."""
    ks = gl.load(ks_base + j + 1)
    acc, t_phase = _pv(j, p, p_mine, v_smem, empty, mine, nxt, t_phase, acc, alpha_prev, zero_o,
                       STAGES, P_EARLY)
    s = _scores(j + 1, q, k_smem, ready, zero_s, STAGES)
    p, alpha, l_i, m_i = _softmax(s, m_i, l_i, qs, ks, (j + 1) * BLOCK_N, L, BLOCK_N, MASK,
                                  s_layout)
    if P_EARLY:
        _store_p(p, p_mine)
    alpha_prev = gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))
    return p, acc, alpha_prev, l_i, m_i, t_phase


@gluon.jit
def _consumer(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, p_smem, q_bar, ready, empty, turn,
              qs_ptr, ks_ptr, vs_ptr, o_ptr, L, Lp, LQ, LQp, H, stride_ob, stride_ol, stride_oh,
              D: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
              STAGES: gl.constexpr, GROUPS: gl.constexpr, P_EARLY: gl.constexpr,
              GROUP: gl.constexpr):
    """One group's 64 query rows over all keys, written to the output."""
    bh = gl.program_id(1)
    bh64 = bh.to(gl.int64)
    n = (L + BLOCK_N - 1) // BLOCK_N
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 32])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, D, 32])
    # turn[g] completes a phase each time the group before g has issued its P V; group 0 goes
    # first (its first wait passes on the barrier's initial phase)
    mine = turn.index(GROUP)
    nxt = turn.index((GROUP + 1) % GROUPS)
    t_phase = 1 if GROUP == 0 else 0
    row0 = gl.program_id(0) * (GROUPS * BLOCK_M) + GROUP * BLOCK_M
    rows_s = row0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
    qs = gl.load(qs_ptr + bh64 * LQp + rows_s, mask=rows_s < LQp, other=0.0)
    ks_base = ks_ptr + bh64 * (Lp // BLOCK_N)
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
    l_i = gl.full([BLOCK_M], 0.0, gl.float32, gl.SliceLayout(1, s_layout))
    acc = gl.zeros([BLOCK_M, D], gl.float32, o_layout)
    zero_s = gl.zeros([BLOCK_M, BLOCK_N], gl.int32, s_layout)
    zero_o = gl.zeros([BLOCK_M, D], gl.float32, o_layout)
    q = q_smem.index(GROUP)
    p_mine = p_smem.index(GROUP)
    mbarrier.wait(q_bar, 0)

    # block 0's scores and softmax (block 0 is whole: L > BLOCK_N)
    s = _scores(0, q, k_smem, ready, zero_s, STAGES)
    p, alpha, l_i, m_i = _softmax(s, m_i, l_i, qs, gl.load(ks_base), 0, L, BLOCK_N, False,
                                  s_layout)
    if P_EARLY:
        _store_p(p, p_mine)
    alpha_prev = gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))
    for j in range(0, n - 2):
        p, acc, alpha_prev, l_i, m_i, t_phase = _block(
            j, p, q, p_mine, k_smem, v_smem, ready, empty, mine, nxt, t_phase, acc, alpha_prev,
            l_i, m_i, qs, ks_base, L, zero_s, zero_o, BLOCK_N, STAGES, False, s_layout, o_layout,
            P_EARLY)
    # the last block's scores are masked past L
    p, acc, alpha_prev, l_i, m_i, t_phase = _block(
        n - 2, p, q, p_mine, k_smem, v_smem, ready, empty, mine, nxt, t_phase, acc, alpha_prev,
        l_i, m_i, qs, ks_base, L, zero_s, zero_o, BLOCK_N, STAGES, True, s_layout, o_layout,
        P_EARLY)
    acc, t_phase = _pv(n - 1, p, p_mine, v_smem, empty, mine, nxt, t_phase, acc, alpha_prev,
                       zero_o, STAGES, P_EARLY)

    # acc and l_i both carry P's factor 448
    offs_d = gl.arange(0, D, layout=gl.SliceLayout(0, o_layout))
    vs = gl.load(vs_ptr + bh64 * D + offs_d)
    l_o = gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))
    out = acc * vs[None, :] / l_o[:, None]
    rows = row0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, o_layout))
    o = o_ptr + (bh // H).to(gl.int64) * stride_ob + (bh % H) * stride_oh
    gl.store(o + rows[:, None] * stride_ol + offs_d[None, :], out.to(o_ptr.dtype.element_ty),
             mask=rows[:, None] < LQ)


@gluon.jit
def hopper_attention_kernel(q_desc, k_desc, v_desc, qs_ptr, ks_ptr, vs_ptr, o_ptr, L, Lp, LQ, LQp,
                            H, stride_ob, stride_ol, stride_oh, D: gl.constexpr,
                            BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                            STAGES: gl.constexpr, GROUPS: gl.constexpr,
                            CONSUMER_REGS: gl.constexpr, P_EARLY: gl.constexpr,
                            num_warps: gl.constexpr):
    gl.static_assert(GROUPS == 3, "the partitions below are three consumer groups")
    q_smem = gl.allocate_shared_memory(gl.int8, [GROUPS, BLOCK_M, D], q_desc.layout)
    k_smem = gl.allocate_shared_memory(gl.int8, [STAGES, BLOCK_N, D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, D, BLOCK_N], v_desc.layout)
    p_smem = gl.allocate_shared_memory(
        gl.float8e4nv, [GROUPS, BLOCK_M, BLOCK_N],
        gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N], gl.float8e4nv))
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [GROUPS, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=GROUPS)  # every consumer group releases a buffer
    for i in gl.static_range(GROUPS):
        mbarrier.init(turn.index(i), count=1)
    # the producer is the default partition (its 4 warps keep the registers the consumers
    # leave); each consumer group is a worker of 4 warps. Every partition takes the same
    # arguments (GROUPS and P_EARLY, then GROUP, last).
    gl.warp_specialize([
        (_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, p_smem, q_bar, ready, empty,
                     turn, qs_ptr, ks_ptr, vs_ptr, o_ptr, L, Lp, LQ, LQp, H, stride_ob, stride_ol,
                     stride_oh, D, BLOCK_M, BLOCK_N, STAGES, GROUPS, P_EARLY, 0)),
        (_consumer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, p_smem, q_bar, ready, empty,
                     turn, qs_ptr, ks_ptr, vs_ptr, o_ptr, L, Lp, LQ, LQp, H, stride_ob, stride_ol,
                     stride_oh, D, BLOCK_M, BLOCK_N, STAGES, GROUPS, P_EARLY, 0)),
        (_consumer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, p_smem, q_bar, ready, empty,
                     turn, qs_ptr, ks_ptr, vs_ptr, o_ptr, L, Lp, LQ, LQp, H, stride_ob, stride_ol,
                     stride_oh, D, BLOCK_M, BLOCK_N, STAGES, GROUPS, P_EARLY, 1)),
        (_consumer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, p_smem, q_bar, ready, empty,
                     turn, qs_ptr, ks_ptr, vs_ptr, o_ptr, L, Lp, LQ, LQp, H, stride_ob, stride_ol,
                     stride_oh, D, BLOCK_M, BLOCK_N, STAGES, GROUPS, P_EARLY, 2)),
    ], [4, 4, 4], [CONSUMER_REGS, CONSUMER_REGS, CONSUMER_REGS])


def _descriptor(t: torch.Tensor, block: list[int], dtype) -> TensorDescriptor:
    return TensorDescriptor.from_tensor(t, block,
                                        gl.NVMMASharedLayout.get_default_for(block, dtype))


def attend(ops, out: torch.Tensor):
    """The kernel over fp8_attention.Fp8Operands `ops` (fp8 P V, head_dim 128, more than 128
    keys), written into out [B, Lq, heads, 128]. Returns the compiled kernel (its n_spills)."""
    b, lq, heads, dim = out.shape
    bh, lqp, _ = ops.q8.shape
    lp = ops.k8.shape[1]
    q_desc = _descriptor(ops.q8.view(bh * lqp, dim), [BLOCK_M, dim], gl.int8)
    k_desc = _descriptor(ops.k8.view(bh * lp, dim), [BLOCK_N, dim], gl.int8)
    v_desc = _descriptor(ops.vt.view(bh * dim, lp), [dim, BLOCK_N], gl.float8e4nv)
    return hopper_attention_kernel[(-(-lq // ROWS_PER_PROGRAM), bh)](
        q_desc, k_desc, v_desc, ops.q_scale, ops.k_scale, ops.v_scale, out, ops.length, lp, lq,
        lqp, heads, *out.stride()[:3], D=dim, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, STAGES=STAGES,
        GROUPS=GROUPS, CONSUMER_REGS=CONSUMER_REGS, P_EARLY=P_EARLY, **BUILD_OPTIONS,
        **KERNEL_OPTIONS)
