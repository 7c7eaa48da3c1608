"""The memory-bound passes around the fp8 matmuls, against the device's copy bandwidth, at Wan's
shapes (one DiT block's tensors):

    python bench/row_kernels_gpu.py --out DIR [--shape 5b 1_3b 14b] [--warps 4 8 16 32]

- the fp8 row kernel (quant/fp8_rows_kernel.py): the codes of an attention output (width dim)
  and of the FFN's GELU (width ffn, with the bias), as launched and with each --warps;
- a block's norms read by fp8 matmuls (wan/glue.py norm_codes: the residual update before the
  norm, the norm, its modulation or affine, the fp8 codes), with each --warps, against the
  same steps compiled by torch.compile (inductor's fused reductions, what the compiled blocks
  ran before).

Each row: median ms (triton.testing.do_bench), the bytes it must move (each input read once,
each output written once), GB/s, and that over a device-to-device copy's GB/s on this machine.
Rows go to DIR/row_kernels.json and .md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from wan_enhanced.bench.harness import bench_ms, device_name, save_result
from wan_enhanced.quant import fp8_rows
from wan_enhanced.wan import compiled_blocks, glue

# tokens, dim, ffn (a forward's tensors at the bench cases' sizes)
SHAPES = {"5b": (27280, 3072, 14336), "1_3b": (32760, 1536, 8960), "14b": (75600, 5120, 13824)}


def copy_gbs(device) -> float:
    x = torch.randn(1 << 28, device=device, dtype=torch.bfloat16)
    y = torch.empty_like(x)
    ms = bench_ms(lambda: y.copy_(x))
    return 2 * x.numel() * x.element_size() / ms / 1e6


def row(name: str, ms: float, nbytes: int, copy: float, **extra) -> dict:
    gbs = nbytes / ms / 1e6
    return {"pass": name, "ms": ms, "bytes": nbytes, "gbs": gbs, "of_copy": gbs / copy, **extra}


def rows_kernel(x: torch.Tensor, bias, gelu: bool, warps: int | None):
    """The row kernel's launch over x, with `warps` per row (None: the shipped choice); the
    codes and scales written into the same buffers each time, made once."""
    if warps is None:
        return lambda: fp8_rows.launch_rows(x, bias, gelu)
    out = (torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device),
           torch.empty(x.shape[0], 1, dtype=torch.float32, device=x.device))
    return lambda: fp8_rows.launch_rows(x, bias, gelu, out=out, warps=warps)


def norm_rows(tokens: int, dim: int, warps: list[int], copy: float, gen, name: str,
              device) -> list[dict]:
    """The block's three norms as codes: self-attention's (the FFN's update added first,
    modulated), cross-attention's (the self-attention's update added first, affine) and the
    FFN's (modulated, nothing added); the kernel, then the steps compiled by inductor."""
    x = torch.randn(1, tokens, dim, device=device, generator=gen) * 4
    y = torch.randn(1, tokens, dim, device=device, generator=gen).to(torch.bfloat16)
    tables = torch.randn(1, 1, 6, dim, device=device, generator=gen) * 0.1
    shift, scale, gate = tables.unbind(2)[:3]
    norm = torch.nn.LayerNorm(dim, eps=1e-6, device=device)
    kinds = {"self-attention norm (update added)": (dict(shift=shift, scale=scale), True),
             "cross-attention norm (update added)": (dict(norm=norm), True),
             "FFN norm": (dict(shift=shift, scale=scale), False)}
    rows = []
    for label, (tables_of, update) in kinds.items():
        pending = (y, gate) if update else None
        nbytes = x.numel() * ((8 + 2) if update else 4) + x.numel() + tokens * 4

        def statement(stream, pending=pending, tables_of=tables_of):
            rows = glue.norm_codes_statement(stream, 1e-6, torch.bfloat16, pending=pending,
                                             **tables_of)
            return rows.codes, rows.scales
        compiled = torch.compile(statement, fullgraph=True, dynamic=False)
        stream = x.clone()
        with torch.no_grad():
            ref = compiled(stream)
            rows.append(row(f"{label} [{tokens}, {dim}]: inductor", bench_ms(
                lambda: compiled(stream)), nbytes, copy, shape=name, warps="inductor"))
            weight = bias = shift_ = scale_ = None
            if "norm" in tables_of:
                weight, bias = norm.weight.float(), norm.bias.float()
            else:
                shift_, scale_ = shift, scale
            for w in [None] + warps:
                def kernel(w=w):
                    return glue.launch_norm_codes(
                        stream, y if update else None, gate if update else None, shift_,
                        scale_, weight, bias, 1e-6, glue.ROUNDINGS[torch.bfloat16], w)
                stream.copy_(x)
                got = kernel()
                stream.copy_(x)
                ref = compiled(stream)
                differing = float((got[0].view(torch.uint8) != ref[0].view(torch.uint8))
                                  .float().mean())
                scales_rel = float(((got[1] - ref[1]).abs() / ref[1]).max())
                rows.append(row(f"{label} [{tokens}, {dim}]: norm_codes_kernel", bench_ms(kernel),
                                nbytes, copy, shape=name, warps=w or "as launched",
                                codes_differing=differing, scales_rel=scales_rel))
    return rows


def run_shape(name: str, warps: list[int], copy: float, device) -> list[dict]:
    tokens, dim, ffn = SHAPES[name]
    gen = torch.Generator(device=device).manual_seed(0)
    out = []
    for label, width, gelu in (("attention output codes", dim, False),
                               ("GELU codes", ffn, True)):
        x = torch.randn(tokens, width, device=device, generator=gen).to(torch.bfloat16)
        bias = (torch.randn(width, device=device, generator=gen).to(torch.bfloat16)
                if gelu else None)
        nbytes = x.numel() * 3 + tokens * 4 + (width * 2 if gelu else 0)
        ref = fp8_rows.launch_rows(x, bias, gelu)
        for w in [None] + warps:
            fn = rows_kernel(x, bias, gelu, w)
            codes, scales = fn()
            same = bool(torch.equal(codes.view(torch.uint8), ref[0].view(torch.uint8))
                        and torch.equal(scales, ref[1]))
            out.append(row(f"{label} [{tokens}, {width}]", bench_ms(fn), nbytes, copy,
                           shape=name, warps=w or "as launched", same_as_launched=same))
        del x, bias, ref
    out += norm_rows(tokens, dim, warps, copy, gen, name, device)
    torch.cuda.empty_cache()
    return out


def markdown(rows: list[dict], copy: float, device: str) -> str:
    lines = [f"Device: {device}; device-to-device copy {copy:.0f} GB/s (bytes read + written).",
             "", "| shape | pass | warps | ms | GB/s | of copy | check |", "|---|---|---|---:|---:|---:|---|"]
    for r in rows:
        check = (f"vs inductor: codes differing {r['codes_differing']:.1e}, scales rel. "
                 f"{r['scales_rel']:.1e}"
                 if "codes_differing" in r else
                 "bitwise = as launched" if r.get("same_as_launched") else
                 "DIFFERS" if "same_as_launched" in r else "reference")
        lines.append(f"| {r['shape']} | {r['pass']} | {r.get('warps', '')} | {r['ms']:.4f} | "
                     f"{r['gbs']:.0f} | {r['of_copy']:.2f} | {check} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--shape", nargs="+", choices=sorted(SHAPES), default=["5b", "1_3b"])
    parser.add_argument("--warps", nargs="*", type=int, default=[4, 8, 16, 32])
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("row_kernels_gpu.py needs a CUDA GPU", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    compiled_blocks._raise_recompile_limit(64)  # the compiled steps: three per shape
    copy = copy_gbs(device)
    rows = [r for name in args.shape for r in run_shape(name, args.warps, copy, device)]
    text = markdown(rows, copy, device_name(device))
    save_result(args.out, "row_kernels", {"device": device_name(device), "copy_gbs": copy,
                                          "rows": rows}, text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
