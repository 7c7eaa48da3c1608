"""Our row kernels (the memory-bound passes of a block) as the fp8 forward launches them, timed
under whichever Triton is importable, with a digest of each output so that two releases'
outputs can be compared bit for bit. Ad-hoc record of this folder's runs:

    python3 row_release.py OUT.json [5b 14b]
"""

import hashlib
import json
import math
import sys

import torch
import triton
from triton.testing import do_bench

from wan_enhanced.quant import fp8_rows
from wan_enhanced.wan import fp8_attention as fa
from wan_enhanced.wan import glue

SHAPES = {"5b": (27280, 3072, 14336, 24), "1_3b": (32760, 1536, 8960, 12),
          "14b": (75600, 5120, 13824, 40)}


def digest(*tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.contiguous().view(torch.uint8).cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def timed(name, fn, nbytes, outputs):
    fn()
    torch.cuda.synchronize()
    result = outputs()
    ms = do_bench(fn, warmup=25, rep=200)
    return {"pass": name, "ms": ms, "gbs": nbytes / ms / 1e6, "digest": digest(*result)}


def shape_rows(name):
    tokens, dim, ffn, heads = SHAPES[name]
    d = dim // heads
    gen = torch.Generator(device="cuda").manual_seed(0)
    cuda = dict(device="cuda")
    bf16 = lambda *s: torch.randn(*s, generator=gen, dtype=torch.bfloat16, **cuda)
    rows = []
    # a norm's fp8 codes, with the residual update before it (glue.norm_codes)
    x0 = torch.randn(1, tokens, dim, generator=gen, dtype=torch.float32, **cuda)
    y, gate = bf16(1, tokens, dim), torch.rand(1, 1, dim, generator=gen, **cuda)
    shift, scale = (torch.randn(1, 1, dim, generator=gen, **cuda) * 0.1 for _ in range(2))
    x = x0.clone()
    out = {}

    def norm_update():
        x.copy_(x0)  # the same stream each time (its copy is timed apart below)
        out["c"] = glue.launch_norm_codes(x, y, gate, shift, scale, None, None, 1e-6, 1)

    copy_ms = do_bench(lambda: x.copy_(x0), warmup=25, rep=200)
    row = timed(f"norm codes + update [{tokens}, {dim}] (incl. a copy of the stream)",
                norm_update, 4 * tokens * dim * 2 + 2 * tokens * dim + tokens * dim,
                lambda: (x, *out["c"]))
    row["copy_ms"] = copy_ms
    rows.append(row)
    rows.append(timed(f"norm codes [{tokens}, {dim}]",
                      lambda: out.__setitem__("n", glue.launch_norm_codes(
                          x, None, None, shift, scale, None, None, 1e-6, 1)),
                      4 * tokens * dim + tokens * dim, lambda: out["n"]))
    # fp8 row codes: an attention output, the FFN's GELU
    a = bf16(tokens, dim)
    rows.append(timed(f"attention output codes [{tokens}, {dim}]",
                      lambda: out.__setitem__("a", fp8_rows.launch_rows(a)),
                      3 * tokens * dim, lambda: out["a"]))
    hidden, bias = bf16(tokens, ffn), bf16(ffn)
    rows.append(timed(f"GELU codes [{tokens}, {ffn}]",
                      lambda: out.__setitem__("g", fp8_rows.launch_rows(hidden, bias, True)),
                      3 * tokens * ffn, lambda: out["g"]))
    # keys: norm + rotation; queries: norm + rotation + int8 codes; K/V quantized
    k_raw, q_raw, v = bf16(1, tokens, dim), bf16(1, tokens, dim), bf16(1, tokens, heads, d)
    w = torch.rand(dim, generator=gen, **cuda) + 0.5
    angles = torch.rand(tokens, 1, d // 2, generator=gen, **cuda) * 6.28
    cos, sin = torch.cos(angles), torch.sin(angles)
    rows.append(timed(f"key norm + rotation [{tokens}, {dim}]",
                      lambda: out.__setitem__("k", glue._rms_norm_rope(
                          k_raw, w, cos, sin, 0, 1e-6, heads)),
                      4 * tokens * dim, lambda: (out["k"],)))
    rows.append(timed(f"query norm + rotation + int8 codes [{tokens}, {dim}]",
                      lambda: out.__setitem__("q", fa.normed_query_codes(
                          q_raw, w, cos, sin, 0, 1e-6, heads)),
                      3 * tokens * dim + 4 * tokens * heads, lambda: out["q"]))
    k = out["k"].view(1, tokens, heads, d)
    rows.append(timed(f"K and V quantized (mean, abs-max, codes) [{tokens}, {dim}] x2",
                      lambda: out.__setitem__("kv", fa.quantize_keys(k, v)),
                      2 * (2 * tokens * dim) + 2 * tokens * dim + 2 * (2 * tokens * dim),
                      lambda: (out["kv"].k8, out["kv"].vt, out["kv"].k_scale,
                               out["kv"].v_scale)))
    for r in rows:
        r["shape"] = name
    return rows


def main():
    path, names = sys.argv[1], sys.argv[2:] or ["5b", "14b"]
    rows = [r for n in names for r in shape_rows(n)]
    info = {"triton": triton.__version__, "torch": torch.__version__,
            "device": torch.cuda.get_device_name(), "rows": rows}
    json.dump(info, open(path, "w"), indent=1)
    print(f"Triton {triton.__version__}, torch {torch.__version__}, {info['device']}")
    for r in rows:
        print(f"{r['shape']:5} {r['pass']:70} {r['ms']:8.4f} ms {r['gbs']:7.0f} GB/s {r['digest']}")


if __name__ == "__main__":
    main()
