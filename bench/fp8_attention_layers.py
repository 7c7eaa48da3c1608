"""The fp8 attention kernel on the attention inputs of a real-size DiT forward, layer by layer.

    python bench/fp8_attention_layers.py --out DIR [--case dit_5b dit_1_3b dit_14b]

One bf16 forward of our DiT on seeded random real-size weights (peer_diffusers.py's cases and
weights) with cuDNN SDPA; at every self-attention the same q, k, v also go through the fp8
kernel, and its output is compared with the bf16 one: cosine similarity and
max |fp8 - bf16| / max |bf16| per layer. The forward itself continues on the bf16 output, so
every layer sees the inputs a bf16 forward gives it. Rows go to DIR/fp8_attention_layers.json
and .md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from wan_enhanced.bench import harness as peer

from wan_enhanced.wan import attention, fp8_attention as fa
from wan_enhanced.wan.dit import WanDiT

CASES = ("dit_5b", "dit_1_3b", "dit_14b")


def run_case(name: str, seed: int, device) -> dict:
    case = peer.CASES[name]
    config = peer.dit_config(case, False)
    with torch.device("meta"):
        skeleton = WanDiT(config)
    state = peer.random_state(skeleton, seed, device, torch.bfloat16)
    model = peer.ours_dit(config, state, torch.bfloat16)
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    noise = torch.randn(case.latent, generator=gen, device=device).to(torch.bfloat16)
    context = torch.randn(1, config.text_len, config.text_dim, generator=gen,
                          device=device).to(torch.bfloat16)
    cudnn = attention.get_backend("sdpa_cudnn")
    fp8 = attention.get_backend("fp8_triton", device, config.head_dim)
    layers = []

    def compare(q, k, v):
        ref = cudnn(q, k, v)
        if k.shape[1] >= fa.MIN_KEYS:
            out = fp8(q, k, v).float()
            r = ref.float()
            layers.append({"layer": len(layers),
                           "cosine": float(F.cosine_similarity(out.flatten(), r.flatten(), 0)),
                           "max_rel": float((out - r).abs().max() / r.abs().max())})
        return ref

    attention._BACKENDS["_compare"] = (compare, None)
    try:
        with torch.inference_mode():
            model(noise, torch.full((1,), peer.TIMESTEP, device=device), context,
                  attention="_compare")
    finally:
        del attention._BACKENDS["_compare"]
    del model, state
    peer.free_memory()
    worst = min(layers, key=lambda r: r["cosine"])
    print(f"{name}: {len(layers)} layers, worst cosine {worst['cosine']:.5f} (layer "
          f"{worst['layer']}), largest max_rel {max(r['max_rel'] for r in layers):.4f}",
          flush=True)
    return {"case": name, "video": case.video, "layers": layers}


def markdown(rows: list[dict]) -> str:
    lines = ["| case | layers | cosine: worst / median | max rel: median / largest |",
             "|---|---:|---|---|"]
    for r in rows:
        cos = sorted(x["cosine"] for x in r["layers"])
        rel = sorted(x["max_rel"] for x in r["layers"])
        lines.append(f"| {r['case']} {r['video']} | {len(cos)} | {cos[0]:.5f} / "
                     f"{cos[len(cos) // 2]:.5f} | {rel[len(rel) // 2]:.4f} / {rel[-1]:.4f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--case", nargs="+", default=list(CASES), choices=CASES)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    device = torch.device("cuda")
    reason = fa.fp8_attention_unavailable(device, 128)
    if reason:
        print(f"fp8 attention cannot run here: {reason}", file=sys.stderr)
        return 2
    rows = [run_case(name, args.seed, device) for name in args.case]
    table = markdown(rows)
    peer.save_result(args.out, "fp8_attention_layers",
                     {"device": peer.device_name(device), "rows": rows}, table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
