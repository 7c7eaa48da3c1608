"""Scratch: attention with Q·K in int8 (as shipped) or fp8 e4m3, against exact float32, on the CPU."""
import math, sys, torch
import torch.nn.functional as F
sys.path.insert(0, "bench")  # run from the repository root
from wan_enhanced.wan import fp8_attention as fa
from fp8_attention_gpu import draw
torch.manual_seed(0)
L, H = 27280, 3
q, k, v = draw(L, H, 0, torch.device("cpu"))
qf, kf, vf = (t.transpose(1, 2).float() for t in (q, k, v))

def to_fp8(x):
    return x.clamp(-448, 448).to(torch.float8_e4m3fn).float()

def attention(qd, kd, vd, pv_fp8=True):
    out = torch.empty_like(qd)
    for s in range(0, L, 4096):
        r = slice(s, s + 4096)
        sc = qd[:, :, r] @ kd.transpose(-1, -2) / math.sqrt(128)
        w = torch.exp(sc - sc.amax(-1, keepdim=True)); tot = w.sum(-1, keepdim=True)
        p = to_fp8(w * 448) / 448 if pv_fp8 else w
        out[:, :, r] = (p @ vd) / tot
    return out

def fp8_q_k(smooth):
    q_scale = qf.abs().amax(-1, keepdim=True).clamp_min(1e-30) / 448
    qd = to_fp8(qf / q_scale) * q_scale
    kk = kf - kf.mean(dim=2, keepdim=True) if smooth else kf
    blocks = F.pad(kk, (0, 0, 0, fa.padded_length(L) - L)).unflatten(2, (-1, 128))
    ks = blocks.abs().amax(dim=(-1, -2), keepdim=True).clamp_min(1e-30) / 448
    kd = (to_fp8(blocks / ks) * ks).flatten(2, 3)[:, :, :L]
    return qd, kd

ref = attention(qf, kf, vf, pv_fp8=False)
_, _, vd = fa.quantized_operands(q, k, v)
def report(name, out):
    o, r = out.transpose(1, 2).double(), ref.transpose(1, 2).double()
    cos_h = F.cosine_similarity(out.double().flatten(2), ref.double().flatten(2), dim=-1)
    print(f"{name:34s} max_rel {float((o-r).abs().max()/r.abs().max()):.4f} rel_l2 {float((o-r).norm()/r.norm()):.4f} "
          f"cos {float(F.cosine_similarity(o.flatten(), r.flatten(), dim=0)):.6f} worst head {float(cos_h.min()):.6f}", flush=True)
qd, kd, _ = fa.quantized_operands(q, k, v)
report("int8 QK (as is), fp8 PV", attention(qd, kd, vd))
report("int8 QK, exact PV", attention(qd, kd, vf, pv_fp8=False))
for smooth in (True, False):
    qd2, kd2 = fp8_q_k(smooth)
    report(f"fp8 QK smooth={smooth}, fp8 PV", attention(qd2, kd2, vd))
    report(f"fp8 QK smooth={smooth}, exact PV", attention(qd2, kd2, vf, pv_fp8=False))
