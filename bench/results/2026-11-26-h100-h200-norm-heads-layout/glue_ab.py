"""Old (HEAD~2) against new q/k norm-and-rotation and normed-query kernels: outputs, times."""
import sys, importlib.util, json, math
import torch, triton
import wan_enhanced.wan
from wan_enhanced.wan import glue, fp8_attention as fa
from wan_enhanced.wan.rope import RotaryTable

def load(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec); sys.modules[name] = mod; spec.loader.exec_module(mod)
    return mod

old_glue = load("wan_enhanced.wan._old_glue_kernels", ".device/var/prev/wan/glue_kernels.py")
src = open(".device/var/prev/wan/fp8_attention_kernels.py").read().replace(
    "from .glue_kernels import", "from ._old_glue_kernels import")
open("/tmp/_old_fak.py", "w").write(src)
old_fak = load("wan_enhanced.wan._old_fak", "/tmp/_old_fak.py")

def old_rope(t, w, cos, sin, start, eps):
    b, length, width = t.shape
    out = torch.empty_like(t)
    block, warps = glue.launch_shape(width // 2)
    old_glue.rms_norm_rope_kernel[(b * length,)](t, w, cos, sin, out, width, cos.shape[-1], eps,
        length, start, ROTATE=True, BLOCK_P=block, num_warps=warps)
    return out

def old_query(q, w, cos, sin, start, eps, heads):
    b, lq, width = q.shape
    dim = width // heads
    lqp, bh = fa.padded_length(lq), b * heads
    q8 = q.new_zeros(bh, lqp, dim, dtype=torch.int8)
    scales = q.new_zeros(bh, lqp, dtype=torch.float32)
    block, warps = glue.launch_shape(width // 2)
    old_fak.normed_query_kernel[(b * lq,)](q, w, cos, sin, q8, scales, width, cos.shape[-1], eps,
        lq, start, heads, lqp, math.log2(math.e) / math.sqrt(dim), BLOCK_P=block, D=dim, num_warps=warps)
    return q8, scales

SHAPES = {"5b": ((31, 22, 40), 24), "1_3b": ((21, 30, 52), 12), "14b": ((21, 45, 80), 40)}
res = {}
for name, (grid, heads) in SHAPES.items():
    rope = RotaryTable(grid, (22, 21, 21), device="cuda")
    L = grid[0] * grid[1] * grid[2]
    W = heads * 128
    g = torch.Generator(device="cuda").manual_seed(0)
    t = (torch.randn(1, L, W, device="cuda", generator=g) * 3 + 0.5).bfloat16()
    w = torch.rand(W, device="cuda", generator=g) + 0.5
    new_r = glue._rms_norm_rope(t, w, rope.cos, rope.sin, 0, 1e-6, heads)
    old_r = old_rope(t, w, rope.cos, rope.sin, 0, 1e-6)
    differ = (new_r != old_r).float().mean().item()
    maxd = (new_r.float() - old_r.float()).abs().max().item()
    nq = fa.normed_query_codes(t, w, rope.cos, rope.sin, 0, 1e-6, heads)
    oq = old_query(t, w, rope.cos, rope.sin, 0, 1e-6, heads)
    two = fa.query_codes(new_r.view(1, L, heads, 128))
    row = {"rope_elements_differing_from_old": differ, "rope_max_abs_diff_from_old": maxd,
           "query_codes_equal_new_two_pass": bool(torch.equal(nq[0][:, :L], two[0][:, :L]) and torch.equal(nq[1][:, :L], two[1][:, :L])),
           "query_codes_differing_from_old": (nq[0][:, :L] != oq[0][:, :L]).float().mean().item()}
    fns = {"rope_old": lambda: old_rope(t, w, rope.cos, rope.sin, 0, 1e-6),
           "rope_new": lambda: glue._rms_norm_rope(t, w, rope.cos, rope.sin, 0, 1e-6, heads),
           "query_old": lambda: old_query(t, w, rope.cos, rope.sin, 0, 1e-6, heads),
           "query_new": lambda: fa.normed_query_codes(t, w, rope.cos, rope.sin, 0, 1e-6, heads)}
    from wan_enhanced.wan import glue_kernels as gk, fp8_attention_kernels as fk
    first, second, _ = glue.head_parts(heads, 128)
    def rope_w(nw):
        out = torch.empty_like(t)
        gk.rms_norm_rope_kernel[(L,)](t, w, rope.cos, rope.sin, out, W, 1e-6, L, 0, ROTATE=True,
            HEADS0=first, HEADS1=second, D=128, num_warps=nw)
    def query_w(nw):
        lqp = fa.padded_length(L)
        q8 = t.new_empty(heads, lqp, 128, dtype=torch.int8); sc = t.new_empty(heads, lqp, dtype=torch.float32)
        fk.normed_query_kernel[(L,)](t, w, rope.cos, rope.sin, q8, sc, W, 1e-6, L, 0, heads, lqp,
            0.1, HEADS0=first, HEADS1=second, D=128, num_warps=nw)
    for nw in (2, 4, 8, 16):
        fns[f"rope_w{nw}"] = (lambda nw=nw: rope_w(nw))
        fns[f"query_w{nw}"] = (lambda nw=nw: query_w(nw))
    times = {k: [] for k in fns}
    for r in range(5):
        for k, f in fns.items():
            times[k].append(triton.testing.do_bench(f, warmup=25, rep=100))
    for k, v in times.items():
        row[k + "_ms"] = sorted(v)[len(v) // 2]
    gb = {"rope": 2 * L * W * 2, "query": L * W * 2 + L * W + L * heads * 4}
    for k in ("rope", "query"):
        for s in ("old", "new"):
            row[f"{k}_{s}_TBps"] = gb[k] / row[f"{k}_{s}_ms"] / 1e9
    res[name] = row
    print(name, json.dumps(row), flush=True)
json.dump(res, open(sys.argv[1], "w"), indent=1)
