"""What a build without fused multiply-adds (Triton 3.10's announced default) would cost our
kernels: the fp8 attention kernels and the row kernels launched as shipped (KERNEL_OPTIONS,
fusion on) and with enable_fp_fusion=False, on the same operands, in turns. Ad-hoc record:

    python3 fusion_off.py OUT.json
"""

import json
import sys

import torch
import triton
from triton.testing import do_bench

from wan_enhanced.quant import fp8_rows
from wan_enhanced.wan import fp8_attention as fa
from wan_enhanced.wan import fp8_attention_hopper as hopper
from wan_enhanced.wan import glue

MODULES = (fa, hopper, glue, fp8_rows)
SHAPES = {"5b": (27280, 24), "14b": (75600, 40)}


def with_fusion(on: bool):
    for module in MODULES:
        module.KERNEL_OPTIONS = {"enable_fp_fusion": on}


def main():
    rows = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    for name, (tokens, heads) in SHAPES.items():
        q, k, v = (torch.randn(1, tokens, heads, 128, generator=gen, device="cuda",
                               dtype=torch.bfloat16) for _ in range(3))
        ops = fa.quantize_only(q, k, v)
        flops = 4 * tokens * tokens * 128 * heads
        width = heads * 128
        x = torch.randn(1, tokens, width, generator=gen, device="cuda")
        shift, scale = (torch.randn(1, 1, width, generator=gen, device="cuda") * 0.1
                        for _ in range(2))
        a = torch.randn(tokens, width, generator=gen, device="cuda", dtype=torch.bfloat16)
        for on in (True, False, True, False):
            with_fusion(on)
            outs = {}
            for kernel in ("hopper", "portable"):
                out = torch.empty_like(q)
                run = lambda: fa.attend_quantized(ops, out, kernel=kernel)
                run()
                ms = do_bench(run, warmup=5, rep=60)
                outs[kernel] = out.clone()
                rows.append({"shape": name, "fusion": on, "pass": f"fp8 attention ({kernel})",
                             "ms": ms, "tflops": flops / ms / 1e9})
            rows[-1]["hopper_equals_portable"] = bool(torch.equal(outs["hopper"],
                                                                  outs["portable"]))
            norm = lambda: glue.launch_norm_codes(x, None, None, shift, scale, None, None,
                                                  1e-6, 1)
            rows.append({"shape": name, "fusion": on, "pass": "norm codes",
                         "ms": do_bench(norm, warmup=10, rep=100)})
            codes = lambda: fp8_rows.launch_rows(a)
            rows.append({"shape": name, "fusion": on, "pass": "attention output codes",
                         "ms": do_bench(codes, warmup=10, rep=100)})
    info = {"triton": triton.__version__, "torch": torch.__version__,
            "device": torch.cuda.get_device_name(), "rows": rows}
    json.dump(info, open(sys.argv[1], "w"), indent=1)
    print(f"Triton {triton.__version__}, torch {torch.__version__}, {info['device']}")
    for r in rows:
        extra = f" {r['tflops']:6.0f} TFLOP/s" if "tflops" in r else ""
        same = f" hopper==portable {r['hopper_equals_portable']}" if "hopper_equals_portable" in r else ""
        print(f"{r['shape']:4} fusion={str(r['fusion']):5} {r['pass']:26} {r['ms']:9.4f} ms{extra}{same}")


if __name__ == "__main__":
    main()
