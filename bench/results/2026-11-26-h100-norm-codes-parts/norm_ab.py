"""Ad hoc: the norm-codes kernel as committed (one block per row, BLOCK_D) against the parts
layout, same inputs, same process: ms (do_bench median), GB/s of copy, codes/scales equality."""
import importlib.util, json, sys, torch, triton, triton.testing
from wan_enhanced.wan import glue
spec = importlib.util.spec_from_file_location("wan_enhanced.wan._old_glue_kernels", ".device/var/old_glue_kernels.py")
old = importlib.util.module_from_spec(spec); spec.loader.exec_module(old)
dev = torch.device("cuda")
x0 = torch.randn(1 << 28, device=dev, dtype=torch.bfloat16); y0 = torch.empty_like(x0)
copy_ms = triton.testing.do_bench(lambda: y0.copy_(x0), warmup=25, rep=200, return_mode="median")
copy = 2 * x0.numel() * 2 / copy_ms / 1e6
del x0, y0
out = {"copy_gbs": copy, "rows": []}
gen = torch.Generator(device=dev).manual_seed(0)
for name, (tokens, d) in {"5b": (27280, 3072), "1_3b": (32760, 1536), "14b": (75600, 5120)}.items():
    x = torch.randn(1, tokens, d, device=dev, generator=gen) * 4
    y = torch.randn(1, tokens, d, device=dev, generator=gen).to(torch.bfloat16)
    tables = torch.randn(1, 1, 6, d, device=dev, generator=gen) * 0.1
    shift, scale, gate = tables.unbind(2)[:3]
    shift, scale = glue._modulation_tables(shift, scale)
    gate = gate.contiguous()
    for upd in (False, True):
        nbytes = x.numel() * ((8 + 2) if upd else 4) + x.numel() + tokens * 4
        def old_launch(w):
            b, length, dd = x.shape
            codes = torch.empty(b * length, dd, dtype=torch.float8_e4m3fn, device=dev)
            scales = torch.empty(b * length, 1, dtype=torch.float32, device=dev)
            old.norm_codes_kernel[(b * length,)](
                x, y if upd else x, gate if upd else x, shift, scale, x, x, codes, scales, length, dd,
                x.stride(0), x.stride(1), length, gate.stride(0), gate.stride(1), length,
                shift.stride(0), shift.stride(1), 1e-6, UPDATE=upd, GATED=upd, MODULATE=True,
                AFFINE=False, ROUNDING=1, BLOCK_D=triton.next_power_of_2(dd), num_warps=w)
            return codes, scales
        def new_launch(w):
            return glue.launch_norm_codes(x, y if upd else None, gate if upd else None, shift, scale,
                                          None, None, 1e-6, 1, w)
        keep = x.clone()
        x.copy_(keep); a = old_launch(glue.codes_warps(d)); xa = x.clone()
        x.copy_(keep); b = new_launch(None); xb = x.clone()
        differ = float((a[0].view(torch.uint8) != b[0].view(torch.uint8)).float().mean())
        srel = float(((a[1] - b[1]).abs() / a[1]).max())
        row = {"shape": name, "update": upd, "x_equal": bool(torch.equal(xa, xb)),
               "codes_differing": differ, "scales_rel": srel}
        for label, fn in (("old", old_launch), ("new", new_launch)):
            for w in (4, 8, 16):
                ms = triton.testing.do_bench(lambda: fn(w), warmup=25, rep=200, return_mode="median")
                row[f"{label}_w{w}"] = ms
        x.copy_(keep)
        out["rows"].append(row)
        best = lambda l: min((row[f"{l}_w{w}"], w) for w in (4, 8, 16))
        print(name, "update" if upd else "plain", {k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()},
              "best old", best("old"), "best new", best("new"), "of copy new", round(nbytes / best("new")[0] / 1e6 / copy, 3))
json.dump(out, open(sys.argv[1], "w"), indent=1)
