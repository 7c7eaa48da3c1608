"""The norm-codes kernel's launch variants, without and with a residual update, at the 5B and
14B widths, under whichever Triton is importable: as launched, other warps, and a register cap
(maxnreg), each checked bit for bit against the launch as shipped. Ad-hoc record:

    python3 norm_codes_variants.py OUT.json
"""

import json
import sys

import torch
import triton
from triton.testing import do_bench

from wan_enhanced.gpu_support import KERNEL_OPTIONS
from wan_enhanced.quant.fp8_rows import row_parts
from wan_enhanced.wan import glue, glue_kernels

SHAPES = {"5b": (27280, 3072), "14b": (75600, 5120)}
VARIANTS = [("as launched", {}), ("8 warps", {"num_warps": 8}), ("16 warps", {"num_warps": 16}),
            ("4 warps, maxnreg 96", {"num_warps": 4, "maxnreg": 96}),
            ("4 warps, maxnreg 80", {"num_warps": 4, "maxnreg": 80})]


def launch(x, y, gate, shift, scale, codes, scales, options):
    b, length, d = x.shape
    parts = row_parts(d)
    gates = x if gate is None else gate
    glue_kernels.norm_codes_kernel[(b * length,)](
        x, x if y is None else y, gates, shift, scale, x, x, codes, scales, length, d,
        x.stride(0), x.stride(1), length if gate is None else length // gate.shape[1],
        gates.stride(0), gates.stride(1), length // shift.shape[1], shift.stride(0),
        shift.stride(1), 1e-6, UPDATE=y is not None, GATED=gate is not None, MODULATE=True,
        AFFINE=False, ROUNDING=1, PART0=parts[0], PART1=parts[1], PART2=parts[2],
        PART3=parts[3], **{"num_warps": glue.CODES_WARPS, **KERNEL_OPTIONS, **options})


def main():
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for name, (tokens, width) in SHAPES.items():
        x0 = torch.randn(1, tokens, width, generator=gen, device="cuda")
        y = torch.randn(1, tokens, width, generator=gen, device="cuda", dtype=torch.bfloat16)
        gate = torch.rand(1, 1, width, generator=gen, device="cuda")
        shift, scale = (torch.randn(1, 1, width, generator=gen, device="cuda") * 0.1
                        for _ in range(2))
        codes = torch.empty(tokens, width, dtype=torch.float8_e4m3fn, device="cuda")
        scales = torch.empty(tokens, 1, device="cuda")
        x = x0.clone()
        for update in (False, True):
            reference = None
            for label, options in VARIANTS:
                def run():
                    if update:
                        x.copy_(x0)
                    launch(x, y if update else None, gate if update else None, shift, scale,
                           codes, scales, options)
                try:
                    run()
                except Exception as exc:  # a variant this Triton refuses
                    rows.append({"shape": name, "update": update, "variant": label,
                                 "error": f"{type(exc).__name__}: {exc}"[:200]})
                    continue
                torch.cuda.synchronize()
                out = (codes.view(torch.uint8).clone(), scales.clone())
                if reference is None:
                    reference = out
                same = torch.equal(out[0], reference[0]) and torch.equal(out[1], reference[1])
                ms = do_bench(run, warmup=10, rep=100)
                rows.append({"shape": name, "update": update, "variant": label, "ms": ms,
                             "same_bits": same})
    info = {"triton": triton.__version__, "device": torch.cuda.get_device_name(), "rows": rows,
            "note": "with an update, each timing includes a copy of the float32 stream"}
    json.dump(info, open(sys.argv[1], "w"), indent=1)
    print(f"Triton {triton.__version__}")
    for r in rows:
        tail = f"{r['ms']:.4f} ms same {r['same_bits']}" if "ms" in r else r["error"]
        print(f"{r['shape']:4} update={str(r['update']):5} {r['variant']:22} {tail}")


if __name__ == "__main__":
    main()
