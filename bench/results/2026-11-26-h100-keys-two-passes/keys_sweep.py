"""Key path configurations: key_stats_kernel (STEP, SPLIT, warps) and normed_key_codes_kernel
(TOKENS, HEADS), timed alone; the bitwise check of normed_keys against quantize_keys of the
normed keys for each."""
import json, sys
import torch
from wan_enhanced.bench.harness import bench_ms
from wan_enhanced.wan import fp8_attention as fa
from wan_enhanced.wan.glue import rms_norm_heads
sys.path.insert(0, "bench/results/2026-11-26-h100-keys-two-passes")
from keys_bench import before, operands

STATS = [(1, 1, 8), (4, 1, 8), (4, 1, 16), (2, 2, 8), (4, 2, 16), (2, 4, 8), (4, 4, 16), (1, 4, 8)]
CODES = [(32, 4, 8), (32, 8, 8), (16, 4, 4), (64, 4, 8), (32, 2, 4)]
rows = []
for name, length, heads in (("5b", 27280, 24), ("14b", 75600, 40), ("1_3b", 32760, 12)):
    k, v, w, rope = operands(length, heads)
    wf = w.float()
    normed = rms_norm_heads(k, w, 1e-6, heads, rope)
    row = {"shape": name, "before_ms": bench_ms(lambda: before(k, v, w, 1e-6, heads, rope))}
    norm = (wf, 1e-6, rope.cos, rope.sin)
    for step, split, warps in STATS:
        fa.STATS_STEP, fa.STATS_SPLIT, fa.STATS_WARPS = step, split, warps
        two = fa.normed_keys(k, v, wf, 1e-6, rope.cos, rope.sin)
        three = fa.quantize_keys(normed, v)
        same = all(torch.equal(getattr(two, n), getattr(three, n)) for n in ("k8", "k_scale", "vt", "v_scale"))
        row[f"stats_{step}_{split}_{warps}"] = (bench_ms(lambda: fa._key_stats(k, v, heads, True, norm)), same)
    best = min(STATS, key=lambda c: row[f"stats_{c[0]}_{c[1]}_{c[2]}"][0])
    fa.STATS_STEP, fa.STATS_SPLIT, fa.STATS_WARPS = best
    for tokens, hh, warps in CODES:
        fa.CODES_TOKENS, fa.CODES_HEADS, fa.CODES_WARPS = tokens, hh, warps
        two = fa.normed_keys(k, v, wf, 1e-6, rope.cos, rope.sin)
        same = torch.equal(two.k8, fa.quantize_keys(normed, v).k8)
        row[f"after_{tokens}_{hh}_{warps}"] = (bench_ms(lambda: fa.normed_keys(k, v, wf, 1e-6, rope.cos, rope.sin)), same)
    row["quantize_keys_normed_ms"] = bench_ms(lambda: fa.quantize_keys(normed, v))
    print(row, flush=True)
    rows.append(row)
json.dump(rows, open(sys.argv[1], "w"), indent=1)
