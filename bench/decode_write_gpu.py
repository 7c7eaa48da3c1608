"""Decoding and writing a video at once (Wan Decode and Save Video) against decoding, then
writing (Wan Tiled Decode, then Wan Save Video), on the Wan2.2 VAE's 1280x704x121 video.

    python bench/decode_write_gpu.py --out DIR [--quick]

One process, one GPU. Seeded random bf16 weights with the released VAE's shapes and one raw
latent (as bench/vae_decode_gpu.py draws them), decoded untiled and on the decode node's `auto`
grid for a 3 GiB budget, each grid warmed up with one decode first. Per grid, in this order:
- serial: decode_to_images, then save_mp4 of its frames (crf 19, 24 fps);
- streamed: decode_to_images with a pipeline.decode_video.StreamedWrite listening, which
  encodes each frame as the decode makes it final; then its finish().
Seconds: the decode (until decode_to_images returns), the write after it, and the sum; the
two files are compared byte for byte (the same frames and settings must give the same file).
--quick runs the tiny VAE on the CPU. Rows go to DIR/decode_write_gpu.json after each grid.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

import torch

from wan_enhanced.bench import harness as peer
from wan_enhanced.pipeline.decode_video import StreamedWrite
from wan_enhanced.pipeline.video_io import default_h264_encoder, save_mp4
from wan_enhanced.vae_tiling.decode import decode_to_images, plan_grid

CASE = "vae22_decode"
MODES = {"untiled": dict(tiled=False), "budget 3 GiB": dict(budget_bytes=3 << 30)}
FPS, CRF = 24, 19


def timed_pair(vae, latent, dtype, grid, out: Path, mode: str) -> dict:
    encoder = default_h264_encoder()
    tag = mode.replace(" ", "_")
    serial, streamed = out / f"{tag}-serial.mp4", out / f"{tag}-streamed.mp4"
    start = time.perf_counter()
    images = decode_to_images(vae, latent, dtype=dtype, grid=grid)
    decoded = time.perf_counter()
    save_mp4(images, serial, fps=FPS, crf=CRF, encoder=encoder, tag=tag, replace=False)
    written = time.perf_counter()
    del images
    write = StreamedWrite(streamed, FPS, CRF, tag=tag, encoder=encoder)
    start2 = time.perf_counter()
    decode_to_images(vae, latent, dtype=dtype, grid=grid, listener=write)
    decoded2 = time.perf_counter()
    write.finish()
    written2 = time.perf_counter()
    same = serial.read_bytes() == streamed.read_bytes()
    row = {"mode": mode, "tiles": len(grid),
           "serial": {"decode_s": decoded - start, "write_s": written - decoded,
                      "total_s": written - start},
           "streamed": {"decode_s": decoded2 - start2, "write_after_decode_s": written2 - decoded2,
                        "total_s": written2 - start2},
           "same_file": same, "bytes": serial.stat().st_size}
    serial.unlink()
    streamed.unlink()
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cpu" if args.quick or not torch.cuda.is_available() else "cuda")
    setup = peer.vae_setup(CASE, args.quick, args.seed, device)
    vae = peer.ours_vae(setup.case.kind, setup.config, setup.state)
    data = {"device": peer.device_name(device),
            "torch": torch.__version__, "date": datetime.date.today().isoformat(),
            "command": " ".join(["python3", "bench/decode_write_gpu.py", *sys.argv[1:]]),
            "video": setup.case.video, "latent": list(setup.latent_shape), "rows": []}
    with torch.inference_mode():
        for mode, tiling in MODES.items():
            grid = plan_grid(vae, setup.latent_shape, **tiling)
            decode_to_images(vae, setup.latent, dtype=setup.dtype, grid=grid)  # warm-up
            row = timed_pair(vae, setup.latent, setup.dtype, grid, args.out, mode)
            data["rows"].append(row)
            print(f"{mode} ({row['tiles']} tiles): serial decode {row['serial']['decode_s']:.2f}"
                  f" + write {row['serial']['write_s']:.2f} = {row['serial']['total_s']:.2f} s;"
                  f" streamed decode {row['streamed']['decode_s']:.2f} + write after "
                  f"{row['streamed']['write_after_decode_s']:.2f} = "
                  f"{row['streamed']['total_s']:.2f} s; same file: {row['same_file']}",
                  flush=True)
            (args.out / "decode_write_gpu.json").write_text(json.dumps(data, indent=1))
            peer.free_memory()
    return 0


if __name__ == "__main__":
    sys.exit(main())
