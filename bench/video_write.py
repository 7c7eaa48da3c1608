"""How fast the H.264 writer encodes a decoded video, by the encoder's threading.

Times pipeline.video_io.save_mp4 on 1280x704x121 frames (the 5B 720p video) for each of
libavcodec's thread types given to libx264 (slice threads: PyAV's default; frame threads), on
two contents: uniform noise (what random-weight models decode to, the worst case for H.264) and
a moving gradient with a little grain (closer to a real video). Each writing is done twice and
the faster kept; the files' sizes are printed beside the times, and each pair of files of one
content is compared frame by frame (max level difference after decoding), since the encoder's
settings (crf, preset) are the same.

    python3 bench/video_write.py --out DIR [--frames 121] [--size 1280x704]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from wan_enhanced.pipeline import video_io

THREAD_TYPES = ("SLICE", "FRAME")


def contents(frames: int, height: int, width: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    noise = torch.rand(frames, height, width, 3, generator=generator)
    t = torch.arange(frames, dtype=torch.float32)[:, None, None, None]
    y = torch.linspace(0, 1, height)[None, :, None, None]
    x = torch.linspace(0, 1, width)[None, None, :, None]
    phase = torch.tensor([0.0, 2.1, 4.2])[None, None, None, :]
    smooth = 0.5 + 0.4 * torch.sin(6 * x + 4 * y + 0.15 * t + phase)
    smooth = (smooth + 0.02 * torch.randn(smooth.shape, generator=generator)).clamp_(0, 1)
    return {"noise": noise, "smooth": smooth}


def write(frames: torch.Tensor, path: Path, thread_type: str) -> float:
    video_io.ENCODER_THREAD_TYPE = thread_type
    best = float("inf")
    for _ in range(2):
        path.unlink(missing_ok=True)
        start = time.perf_counter()
        video_io.save_mp4(frames, path, fps=24, crf=19)
        best = min(best, time.perf_counter() - start)
    return best


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--frames", type=int, default=121)
    parser.add_argument("--size", default="1280x704")
    args = parser.parse_args(argv)
    width, height = map(int, args.size.split("x"))
    args.out.mkdir(parents=True, exist_ok=True)
    records = []
    for name, frames in contents(args.frames, height, width).items():
        files = {}
        for thread_type in THREAD_TYPES:
            path = args.out / f"{name}-{thread_type.lower()}.mp4"
            seconds = write(frames, path, thread_type)
            files[thread_type] = path
            records.append({"content": name, "thread_type": thread_type, "seconds": seconds,
                            "fps": args.frames / seconds, "bytes": path.stat().st_size})
            print(f"{name:7s} {thread_type:6s} {seconds:6.2f} s  {args.frames / seconds:6.1f} "
                  f"fps  {path.stat().st_size / 2**20:7.1f} MiB", flush=True)
        a, _ = video_io.read_mp4(files["SLICE"])
        b, _ = video_io.read_mp4(files["FRAME"])
        source = (frames * 255).round().to(torch.uint8)
        for thread_type, decoded in (("SLICE", a), ("FRAME", b)):
            error = (decoded.float() - source.float()).abs().mean().item()
            print(f"{name:7s} {thread_type:6s} mean |decoded - source| {error:.2f} levels")
            records.append({"content": name, "thread_type": thread_type,
                            "mean_abs_level_error": error})
    (args.out / "video_write.json").write_text(json.dumps(
        {"cpus": os.cpu_count(), "frames": args.frames, "size": args.size,
         "encoder": video_io.default_h264_encoder(), "records": records}, indent=1))
    for path in args.out.glob("*.mp4"):
        path.unlink()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
