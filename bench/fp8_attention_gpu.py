"""Our attention kernels (fp8, and the exact bf16 Hopper one) against SDPA at Wan's
self-attention shapes: speed and error.

    python bench/fp8_attention_gpu.py --out DIR [--shape 5b 14b 1_3b] [--configs]

For each shape (batch 1, head_dim 128): q, k, v drawn in bf16 with the traits of Wan's
activations (a shared per-channel offset on the keys, a few large channels), then
  - SDPA with cuDNN first (what ComfyUI and our "sdpa_cudnn" run) and its default choice;
  - the fp8 backend whole (quantization + kernel: the Hopper kernel where it runs), the kernel
    alone on operands quantized beforehand (what the kernel's TFLOP/s are), the same
    with the portable kernel (whose output the Hopper kernel must equal bit for bit), and the
    quantization alone;
  - our exact kernel (bf16_hopper, on Hopper GPUs), and at 512 keys (text cross-attention)
    against cuDNN, which is why shorter key sequences stay on cuDNN;
  - with --configs, every kernel configuration on its own.
TFLOP/s count 4 * L^2 * head_dim * heads (both products). Errors of the fp8 output against
bf16 SDPA and against a float32 reference (SDPA on float32 inputs): max |diff| / max |ref|,
relative L2 and cosine similarity, per head (worst head) and overall; and the kernel against
reference_fp8_attention (the same numerics in PyTorch) on the first heads, which must agree to
float32 rounding. Rows go to DIR/fp8_attention.json and .md.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from wan_enhanced.bench.harness import bench_ms, device_name, save_result
from wan_enhanced.gpu_support import triton_version
from wan_enhanced.wan import bf16_attention as ba, fp8_attention as fa
from wan_enhanced.wan.attention import get_backend

SHAPES = {"5b": (27280, 24), "14b": (75600, 40), "1_3b": (32760, 12)}


def draw(length: int, heads: int, seed: int, device) -> tuple[torch.Tensor, ...]:
    """RMS-normed queries and keys (as the model's norm_q / norm_k leave them) with per-channel
    gains and a shared offset on the keys; uncorrelated values (the hardest case for the
    rounding of P: the output is as small as averaging makes it)."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device)

    gain = (1 + 0.5 * randn(128)).abs()
    q = F.rms_norm(randn(1, length, heads, 128) + 0.3 * randn(1, 1, heads, 128), (128,)) * gain
    k = F.rms_norm(randn(1, length, heads, 128) + 1.0 * randn(1, 1, heads, 128), (128,)) * gain
    v = randn(1, length, heads, 128)
    return tuple(t.to(torch.bfloat16) for t in (q, k, v))


def errors(out: torch.Tensor, ref: torch.Tensor) -> dict:
    o, r = out.float(), ref.float()
    per_head_cos = F.cosine_similarity(o.transpose(1, 2).flatten(2), r.transpose(1, 2).flatten(2),
                                       dim=-1)
    return {"max_rel": float((o - r).abs().max() / r.abs().max()),
            "rel_l2": float((o - r).norm() / r.norm()),
            "cosine": float(F.cosine_similarity(o.flatten(), r.flatten(), dim=0)),
            "worst_head_cosine": float(per_head_cos.min())}


def float32_reference(q, k, v) -> torch.Tensor:
    out = torch.empty_like(q, dtype=torch.float32)
    for h in range(q.shape[2]):  # a head at a time: the float32 scores of all heads are large
        sl = (slice(None), slice(None), slice(h, h + 1))
        out[sl] = F.scaled_dot_product_attention(
            *(t[sl].float().transpose(1, 2) for t in (q, k, v))).transpose(1, 2)
    return out


def run_shape(name: str, args, device) -> dict:
    length, heads = SHAPES[name]
    q, k, v = draw(length, heads, args.seed, device)
    flops = 4 * length ** 2 * 128 * heads
    row = {"shape": name, "tokens": length, "heads": heads}
    cudnn = get_backend("sdpa_cudnn")
    sdpa = get_backend("sdpa")
    with torch.inference_mode():
        ref_bf16 = cudnn(q, k, v)
        out = fa.fp8_attention(q, k, v)
        ref32 = float32_reference(q, k, v)
        row["fp8_vs_bf16"] = errors(out, ref_bf16)
        row["fp8_vs_fp32"] = errors(out, ref32)
        row["bf16_vs_fp32"] = errors(ref_bf16, ref32)
        hopper16 = None
        if ba.bf16_hopper_unavailable(device, 128) is None:
            hopper16 = get_backend("bf16_hopper", device, 128)
            row["bf16_hopper_vs_fp32"] = errors(hopper16(q, k, v), ref32)
        bf16pv = fa._launch(q, k, v, pv_fp8=False)
        row["int8_bf16pv_vs_fp32"] = errors(bf16pv, ref32)
        del bf16pv
        few = (slice(None), slice(None), slice(0, 2))
        emulated = fa.reference_fp8_attention(q[few], k[few], v[few])
        row["kernel_vs_emulation"] = errors(out[few], emulated)
        del ref32, emulated
        ops = fa.quantize_only(q, k, v)
        row["fp8_kernel"] = ("hopper" if fa.hopper_kernel_unavailable(ops, out) is None
                             else "portable")
        portable = torch.empty_like(out)
        fa.attend_quantized(ops, portable, kernel="portable")
        row["fp8_bitwise_equal_to_portable"] = bool(torch.equal(portable, out))
        del portable

        def fp8_kernel_alone(ops=ops, out=out):  # on operands quantized beforehand
            fa.attend_quantized(ops, out)

        def fp8_portable():  # quantization included, as in fp8_attention
            ops = fa.quantize_only(q, k, v)
            fa.attend_quantized(ops, torch.empty_like(q), kernel="portable")

        for label, fn in (("sdpa_cudnn", lambda: cudnn(q, k, v)), ("sdpa", lambda: sdpa(q, k, v)),
                          ("fp8", lambda: fa.fp8_attention(q, k, v)),
                          ("fp8_kernel_alone", fp8_kernel_alone),
                          ("fp8_portable", fp8_portable),
                          ("int8_bf16pv", lambda: fa._launch(q, k, v, pv_fp8=False)),
                          ("fp8_quantize_only", lambda: fa.quantize_only(q, k, v)),
                          *((("bf16_hopper", lambda: hopper16(q, k, v)), ) if hopper16 else ())):
            ms = bench_ms(fn)
            row[f"{label}_ms"] = ms
            row[f"{label}_tflops"] = flops / ms / 1e9
            print(f"  {name} {label}: {ms:.2f} ms, {flops / ms / 1e9:.0f} TFLOP/s", flush=True)
        del ops, fp8_kernel_alone
        if hopper16 is not None:  # text cross-attention: 512 keys
            kt, vt = k[:, :512].contiguous(), v[:, :512].contiguous()
            out = torch.empty_like(q)
            for label, fn in (("cross512_sdpa_cudnn", lambda: cudnn(q, kt, vt)),
                              ("cross512_bf16_hopper_kernel",
                               lambda: ba._kernel_module().attend(q, kt, vt, out))):
                row[f"{label}_ms"] = bench_ms(fn)
                print(f"  {name} {label}: {row[f'{label}_ms']:.3f} ms", flush=True)
        if args.configs:
            row["configs"] = {}
            from wan_enhanced.wan.fp8_attention_kernels import attention_configs
            for config in attention_configs():
                kw = dict(config.kwargs, num_warps=config.num_warps,
                          num_stages=config.num_stages)
                label = "_".join(f"{k}{v}" for k, v in kw.items())
                try:
                    ms = bench_ms(lambda: fa._launch(q, k, v, kw))
                    row["configs"][label] = ms
                    print(f"    {label}: {ms:.2f} ms {flops / ms / 1e9:.0f} TFLOP/s", flush=True)
                except Exception as error:  # a configuration the compiler refuses
                    row["configs"][label] = f"error: {str(error)[:120]}"
                    print(f"    {label}: {str(error)[:120]}", flush=True)
    print(f"  {name} errors: {json.dumps({k: v for k, v in row.items() if 'vs' in k})}",
          flush=True)
    return row


def markdown(rows: list[dict]) -> str:
    lines = ["| shape | tokens x heads | cuDNN ms (TFLOP/s) | bf16 Hopper ms (TFLOP/s) | "
             "fp8 ms (TFLOP/s), kernel | fp8 kernel alone ms (TFLOP/s) | "
             "portable kernel ms (TFLOP/s) | quantize ms | "
             "fp8 vs bf16: max rel / cos / worst head cos | fp8 vs fp32 max rel | "
             "cuDNN vs fp32 max rel | bf16 Hopper vs fp32 max rel | "
             "kernel vs emulation rel L2 |", "|" + "---|" * 13]
    for r in rows:
        e, f32, b32 = r["fp8_vs_bf16"], r["fp8_vs_fp32"], r["bf16_vs_fp32"]
        h16 = (f"{r['bf16_hopper_ms']:.2f} ({r['bf16_hopper_tflops']:.0f})"
               if "bf16_hopper_ms" in r else "-")
        h16_err = (f"{r['bf16_hopper_vs_fp32']['max_rel']:.4f}" if "bf16_hopper_vs_fp32" in r
                   else "-")
        lines.append(
            f"| {r['shape']} | {r['tokens']} x {r['heads']} | {r['sdpa_cudnn_ms']:.2f} "
            f"({r['sdpa_cudnn_tflops']:.0f}) | {h16} | {r['fp8_ms']:.2f} ({r['fp8_tflops']:.0f}), "
            f"{r['fp8_kernel']} | {r['fp8_kernel_alone_ms']:.2f} "
            f"({r['fp8_kernel_alone_tflops']:.0f}) | {r['fp8_portable_ms']:.2f} ({r['fp8_portable_tflops']:.0f}) | "
            f"{r['fp8_quantize_only_ms']:.2f} | {e['max_rel']:.4f} / {e['cosine']:.5f} / "
            f"{e['worst_head_cosine']:.5f} | {f32['max_rel']:.4f} | {b32['max_rel']:.4f} | "
            f"{h16_err} | "
            f"{r['kernel_vs_emulation']['rel_l2']:.2e} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--shape", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--configs", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    device = torch.device("cuda")
    reason = fa.fp8_attention_unavailable(device, 128)
    if reason:
        print(f"fp8 attention cannot run here: {reason}", file=sys.stderr)
        return 2
    rows = [run_shape(name, args, device) for name in args.shape]
    meta = {"device": device_name(device), "torch": torch.__version__,
            "triton": triton_version(), "command": " ".join(sys.argv)}
    table = (f"Device: {meta['device']}, torch {meta['torch']}, Triton {meta['triton']}.\n\n"
             + markdown(rows))
    save_result(args.out, "fp8_attention", {"meta": meta, "rows": rows}, table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
