"""The fp8 attention's key path alone: before (rms_norm_heads, then torch mean / inf-norm and the
two codes kernels) and after (normed_keys: two passes over the projection), at Wan's shapes."""
import json, math, sys
import torch
from wan_enhanced.bench.harness import bench_ms
from wan_enhanced.wan import fp8_attention as fa, fp8_attention_kernels as kern
from wan_enhanced.wan.glue import rms_norm_heads
from wan_enhanced.wan.configs import DiTConfig
from wan_enhanced.wan.rope import RotaryTable


def before(k, v, w, eps, heads, rope):
    normed = rms_norm_heads(k, w, eps, heads, rope)
    b, length, _, dim = normed.shape
    lp, bh = fa.padded_length(length), b * heads
    k8 = normed.new_empty(bh, lp, dim, dtype=torch.int8)
    vt = normed.new_empty(bh, dim, lp, dtype=torch.float8_e4m3fn)
    ks = normed.new_empty(bh, lp // 128, dtype=torch.float32)
    vs = (torch.linalg.vector_norm(v, ord=math.inf, dim=1, dtype=torch.float32)
          .clamp_min(1e-30).div_(448.0).reshape(bh, dim).contiguous())
    mean = normed.mean(dim=1, dtype=torch.float32).reshape(bh, dim).contiguous()
    grid = (lp // 128, bh)
    kern.quantize_k_kernel[grid](normed, mean, k8, ks, length, lp, heads, *normed.stride()[:3],
                                 BLOCK=128, D=dim)
    kern.quantize_vt_kernel[grid](v, vs, vt, length, lp, heads, *v.stride()[:3], BLOCK=128, D=dim)
    return k8, ks, vt, vs


def operands(length, heads):
    """Projected keys with a shared offset, values, the norm's gain and the rotation's tables."""
    width = heads * 128
    g = torch.Generator(device="cuda").manual_seed(0)
    k = (torch.randn(1, length, width, device="cuda", generator=g)
         + 2 * torch.randn(1, 1, width, device="cuda", generator=g)).bfloat16()
    v = torch.randn(1, length, heads, 128, device="cuda", generator=g).bfloat16()
    w = (1 + 0.3 * torch.randn(width, device="cuda", generator=g)).bfloat16()
    rope = RotaryTable((1, 1, length), DiTConfig(dim=width, num_heads=heads).rope_pairs,
                       device="cuda")
    return k, v, w, rope


def main():
  rows = []
  for name, length, heads in (("5b", 27280, 24), ("1_3b", 32760, 12), ("14b", 75600, 40)):
      k, v, w, rope = operands(length, heads)
      wf = w.float()
      old = before(k, v, w, 1e-6, heads, rope)
      new = fa.normed_keys(k, v, wf, 1e-6, rope.cos, rope.sin)
      same = {n: bool(torch.equal(a, getattr(new, n))) for a, n in zip(old, ("k8", "k_scale", "vt", "v_scale"))}
      k8diff = int((old[0].int() - new.k8.int()).abs().max())
      normed = rms_norm_heads(k, w, 1e-6, heads, rope)
      row = {"shape": name, "same_as_before": same, "k8_max_code_diff": k8diff}
      for _ in range(2):
          row["before_ms"] = bench_ms(lambda: before(k, v, w, 1e-6, heads, rope))
          row["after_ms"] = bench_ms(lambda: fa.normed_keys(k, v, wf, 1e-6, rope.cos, rope.sin))
          row["quantize_keys_normed_ms"] = bench_ms(lambda: fa.quantize_keys(normed, v))
          row["stats_only_ms"] = bench_ms(lambda: fa._key_stats(k, v, heads, True, (wf, 1e-6, rope.cos, rope.sin)))
      print(row, flush=True)
      rows.append(row)
  json.dump(rows, open(sys.argv[1], "w"), indent=1)


if __name__ == '__main__':
    main()
