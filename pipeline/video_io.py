"""IMAGE frames to MP4 (H.264 through PyAV), numbered output names, and reading an MP4 back.

Quality is a CRF number, 0..51, as in ffmpeg/x264 and ComfyUI's video nodes: lower is better
and larger; 17-19 looks lossless to most eyes, 23 is x264's default, +6 roughly halves the size.
0 is mathematically lossless but needs the High 4:4:4 profile, which browsers do not play.

Files are written next to their destination under a hidden temporary name and renamed when
complete, so a failed or interrupted write never leaves a half-written video. A numbered name is
claimed across processes before the video is written (claim_output_path), and the finished file
never replaces another: several processes writing into one folder each keep every video. The
claim's token goes into the file's metadata (read_tag), so that a record of it can be checked.
"""

from __future__ import annotations

import functools
import os
import re
import threading
import time
from fractions import Fraction
from pathlib import Path
from typing import Callable, Iterable, Iterator

import numpy as np
import torch

from ..atomic_files import Claim, atomic_target, claim, remove_stale_partials
from ..safe_paths import UnsafePathError, check_inside, name_problem, relative_parts

DEFAULT_CRF = 19
# Preferred first. libx264 ships with PyAV's wheels; the others cover builds without it.
H264_ENCODERS = ("libx264", "libopenh264", "h264_videotoolbox", "h264_nvenc", "h264_qsv",
                 "h264_amf", "h264_mf", "h264_vaapi")
PIXEL_FORMAT = "yuv420p"  # what every player decodes
BT709 = 1  # colour matrix, primaries and transfer tag (the HD standard; browsers assume it)
# how libavcodec spreads the encoder over the CPU's cores: "FRAME" (frames in flight at once)
# or "SLICE" (each frame cut into slices, PyAV's default); bench/video_write.py measures both
ENCODER_THREAD_TYPE = "FRAME"


TAG_PREFIX = "wan-enhanced "  # the container's comment: TAG_PREFIX + the write's token


def save_mp4(frames, path: str | Path, fps: float = 16, crf: int = DEFAULT_CRF,
             encoder: str | None = None, tag: str | None = None, replace: bool = True,
             frame_ready: Callable[[int], None] | None = None) -> Path:
    """Encode `frames` to an H.264 MP4 at `path` and return the path.

    frames: an IMAGE tensor [F,H,W,3] (float 0..1, or uint8 0..255), a numpy array of the same
    form, or any iterable of [H,W,3] frames; frames are converted one at a time, so the video is
    never held twice. The folder must exist. An existing file at `path` is replaced, unless
    replace=False (then FileExistsError, nothing replaced). tag: a token written into the
    file's metadata (read_tag gives it back).
    frame_ready(index): with an IMAGE tensor, called before frame `index` is read; it returns
    once the frame holds its final values (a tensor still being filled, pipeline/
    decode_video.py) and whatever it raises stops the write, leaving no file."""
    path = Path(path)
    if frame_ready is not None and not (isinstance(frames, torch.Tensor) and frames.ndim == 4):
        raise TypeError("frame_ready needs the frames as one IMAGE tensor [F,H,W,3]")
    rate = check_video_settings(fps, crf)
    encoder = encoder or default_h264_encoder()
    with atomic_target(path, path.name, make_folder=False, replace=replace) as temp:
        _encode(_uint8_frames(frames, frame_ready), temp, rate, int(crf), encoder, tag)
    return path


def check_video_settings(fps, crf) -> Fraction:
    """The frame rate as a fraction; ValueError for an fps or crf save_mp4 cannot write."""
    rate = _frame_rate(fps)
    if not (isinstance(crf, (int, np.integer)) and 0 <= crf <= 51):
        raise ValueError(f"crf must be an integer from 0 to 51 (lower is better), got {crf!r}")
    return rate


def read_tag(path: str | Path) -> str | None:
    """The token save_mp4 wrote into the file, or None (no token, not an MP4 we read)."""
    try:
        with _av().open(str(path)) as container:
            comment = container.metadata.get("comment", "")
    except Exception:  # absent, truncated, not a video: no token to tell
        return None
    return comment[len(TAG_PREFIX):] if comment.startswith(TAG_PREFIX) else None


def read_mp4(path: str | Path) -> tuple[torch.Tensor, float]:
    """All frames of the first video stream as uint8 RGB [F,H,W,3], and the frame rate."""
    av = _av()
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        rate = stream.average_rate or stream.guessed_rate or stream.base_rate
        frames = [frame.to_ndarray(format="rgb24") for frame in container.decode(stream)]
    if not frames:
        raise ValueError(f"{path} has no video frames")
    return torch.from_numpy(np.stack(frames)), float(rate)


# -- numbered names ----------------------------------------------------------------------------

_numbering_lock = threading.Lock()


def _av():
    """PyAV, imported where video is read or written: the codec libraries load only then."""
    import av
    return av


def next_output_path(folder: str | Path, prefix: str, ext: str = ".mp4") -> Path:
    """The next free name folder/prefix_00001.mp4, prefix_00002.mp4, …, as ComfyUI numbers its
    outputs. `prefix` may name subfolders ("wan/clip"), which are created and must stay inside
    `folder` (safe_paths.py: no absolute path, no '..', no link leading out). The number
    follows the highest one in use with any extension (a video's preview image keeps its
    number) and files still being written count as in use."""
    folder = Path(folder)
    problem = name_problem(prefix)
    if problem is not None:
        raise UnsafePathError(f"filename_prefix: {problem}")
    *subfolders, name = relative_parts(prefix) or ("",)
    if not name or prefix.replace("\\", "/").endswith("/"):
        raise UnsafePathError(f"filename_prefix: {prefix!r} has an empty file name (it ends "
                              f"in a folder)")
    target = folder.joinpath(*subfolders)
    check_inside(folder, target / name, "filename_prefix", prefix)
    ext = ext if ext.startswith(".") else f".{ext}"
    with _numbering_lock:
        try:
            target.mkdir(parents=True, exist_ok=True)
            remove_stale_partials(target)  # their numbers would stay taken for ever
            names = os.listdir(target)
        except OSError as error:
            raise OSError(error.errno, f"cannot use the output folder {target}: "
                                       f"{error.strerror or error}") from error
        # ComfyUI's own images are named prefix_00001_.png: their numbers count as taken too.
        numbered = re.compile(rf"^\.?{re.escape(name)}_(\d{{5,}})_?\.")
        used = [int(match.group(1)) for match in map(numbered.match, names) if match]
        return target / f"{name}_{max(used, default=0) + 1:05d}{ext}"


def expand_filename_variables(prefix: str, width: int, height: int,
                              now: time.struct_time | None = None) -> str:
    """ComfyUI's filename variables, expanded as its savers expand them: %width% and %height%
    of the frames, %year%, %month%, %day%, %hour%, %minute%, %second% of the local time (two
    digits but the year). (%date:...% and %Node.widget% are the editor's: it expands them before
    a prompt is sent.)"""
    if "%" not in prefix:
        return prefix
    now = now or time.localtime()
    values = {"width": width, "height": height, "year": now.tm_year,
              "month": f"{now.tm_mon:02d}", "day": f"{now.tm_mday:02d}",
              "hour": f"{now.tm_hour:02d}", "minute": f"{now.tm_min:02d}",
              "second": f"{now.tm_sec:02d}"}
    for name, value in values.items():
        prefix = prefix.replace(f"%{name}%", str(value))
    return prefix


CLAIM_ATTEMPTS = 1000
# the longest name written beside a video NAME_00001.mp4: its hidden temporary file
# .NAME_00001.mp4.PID@START-TOKEN.partial (a process id of up to 10 digits, a start time of 13)
_LONGEST_EXTRA = len(".") + len(".") + 10 + len("@") + 13 + len("-") + 8 + len(".partial")


def video_name_problem(folder: str | Path, prefix: str, ext: str = ".mp4") -> str | None:
    """Why videos named by `prefix` could not be written into `folder`, found before anything
    runs: a prefix that ends in a folder, or a name the file system cannot hold with the
    hidden temporary name written beside it (its longest file name, in bytes)."""
    if not isinstance(prefix, str):
        return None
    *_, name = relative_parts(prefix) or ("",)
    if not name or prefix.replace("\\", "/").endswith("/"):
        return f"filename_prefix: {prefix!r} has an empty file name (it ends in a folder)"
    try:
        limit = os.pathconf(folder, "PC_NAME_MAX") if os.path.isdir(folder) else 255
    except (OSError, ValueError):
        limit = 255
    longest = len(os.fsencode(f"{name}_00001{ext}")) + _LONGEST_EXTRA
    if longest > limit:
        room = limit - _LONGEST_EXTRA - len(os.fsencode(f"_00001{ext}"))
        return (f"filename_prefix: its last part is {len(os.fsencode(name))} bytes in UTF-8, "
                f"more than the {room} bytes left of the file system's {limit} a name once "
                f"the number, the extension and the hidden temporary name written beside the "
                f"video are counted")
    return None


def claim_output_path(folder: str | Path, prefix: str, ext: str = ".mp4") -> Claim:
    """The next free numbered name (next_output_path), reserved across processes: a writer
    into the same folder meanwhile gets the next number. Release the claim when the file is
    written (or was not)."""
    for _ in range(CLAIM_ATTEMPTS):
        path = next_output_path(folder, prefix, ext)
        claimed = claim(path)
        if claimed is not None:
            return claimed
    raise OSError(f"cannot claim a numbered name for {prefix!r} in {folder}: {CLAIM_ATTEMPTS} "
                  f"names in a row were taken while trying")


# -- encoding ----------------------------------------------------------------------------------

def _encode(frames: Iterator[np.ndarray], temp: Path, rate: Fraction, crf: int,
            encoder: str, tag: str | None = None) -> None:
    # faststart moves the index to the front so browsers (ComfyUI's preview) play while loading.
    av = _av()
    with av.open(str(temp), mode="w", format="mp4",
                 options={"movflags": "+faststart"}) as container:
        if tag is not None:
            container.metadata["comment"] = TAG_PREFIX + tag
        stream = None
        for index, rgb in enumerate(frames):
            if stream is None:
                stream = _add_stream(container, encoder, rate, crf, rgb.shape[1], rgb.shape[0])
            frame = av.VideoFrame.from_ndarray(rgb, format="rgb24")
            frame = frame.reformat(format=PIXEL_FORMAT, dst_colorspace="ITU709",
                                   dst_color_range="MPEG")
            frame.pts = index
            container.mux(stream.encode(frame))
        if stream is None:
            raise ValueError("no frames to write")
        container.mux(stream.encode(None))  # flush the encoder's delayed frames


def _add_stream(container, encoder: str, rate: Fraction, crf: int, width: int, height: int):
    stream = container.add_stream(encoder, rate=rate)
    stream.width, stream.height, stream.pix_fmt = width, height, PIXEL_FORMAT
    context = stream.codec_context
    context.time_base = 1 / rate
    context.colorspace = context.color_primaries = context.color_trc = BT709
    context.color_range = 1  # limited ("MPEG") range, what players expect from yuv420p
    context.thread_count = 0  # as many as the CPU has
    context.thread_type = ENCODER_THREAD_TYPE
    _set_quality(stream, encoder, crf, width * height * float(rate))
    return stream


def _set_quality(stream, encoder: str, crf: int, pixels_per_second: float) -> None:
    if encoder == "libx264":
        # Without x264's macroblock-tree rate control: with it, encoding the same frames gave
        # different files from run to run at small frame sizes (160x96, 320x192: decoded
        # values up to 60 levels apart), so a seed did not give one video.
        stream.options = {"crf": str(crf), "preset": "medium", "x264-params": "mbtree=0"}
    elif encoder == "h264_nvenc":
        stream.options = {"rc": "vbr", "cq": str(crf)}
    else:
        # Encoders without a CRF mode: a bit rate from the usual rule that +6 CRF halves it,
        # anchored at about 0.1 bit per pixel for CRF 23.
        stream.codec_context.bit_rate = int(0.1 * 2 ** ((23 - crf) / 6) * pixels_per_second)


@functools.cache
def default_h264_encoder() -> str:
    """The first H.264 encoder of H264_ENCODERS that this PyAV build has and that opens here
    (hardware encoders are compiled in even where their hardware is absent)."""
    av = _av()
    for name in H264_ENCODERS:
        try:
            context = av.CodecContext.create(name, "w")
            context.width, context.height, context.pix_fmt = 64, 64, PIXEL_FORMAT
            context.time_base = Fraction(1, 16)
            context.open()
            return name
        except Exception:
            continue
    raise RuntimeError("this PyAV build has no usable H.264 encoder "
                       f"(tried {', '.join(H264_ENCODERS)})")


# -- frames ------------------------------------------------------------------------------------

def _uint8_frames(frames, frame_ready=None) -> Iterator[np.ndarray]:
    """RGB uint8 frames [H,W,3] of one size, with even sides, one at a time.

    A frame yielded may be overwritten once the next one is asked for (the consumer copies it
    into the encoder's frame first). Frames of a tensor are converted one ahead, in a worker
    thread, into buffers used in turn: the conversion runs while the encoder works, and no
    frame allocates memory of its own (a fresh 10 MB float copy a frame was most of a 720p
    video's writing time where page faults are dear)."""
    if isinstance(frames, torch.Tensor) and frames.ndim == 4 and frames.shape[-1] == 3 \
            and frames.shape[0] > 0:
        yield from _converted_ahead(frames, frame_ready)
        return
    if isinstance(frames, (torch.Tensor, np.ndarray)):
        if frames.ndim != 4:
            raise ValueError(f"expected frames [F,H,W,3], got shape {tuple(frames.shape)}")
        frames = iter(frames)  # one [H,W,3] view at a time
    elif not isinstance(frames, Iterable):
        raise TypeError(f"expected an IMAGE tensor or an iterable of frames, got {type(frames)}")
    first_size = None
    for index, frame in enumerate(frames):
        rgb = _to_uint8(frame)
        first_size = first_size or rgb.shape[:2]
        if rgb.shape[:2] != first_size:
            raise ValueError(f"frame {index} is {rgb.shape[1]}x{rgb.shape[0]}, "
                             f"the first was {first_size[1]}x{first_size[0]}")
        yield _pad_to_even(rgb)


class _FrameConverter:
    """A tensor's frames to uint8, the same operations as _to_uint8 written into two buffer
    pairs used in turn (frame k's pair is reused for frame k + 2)."""

    def __init__(self, frames: torch.Tensor, frame_ready=None):
        # (an inference tensor has no graph to leave, and some PyTorch releases refuse to
        # detach one outside inference mode)
        self.frames = frames if frames.is_inference() else frames.detach()
        self.frame_ready = frame_ready
        shape = tuple(self.frames.shape[1:])
        self.work = [torch.empty(shape, dtype=torch.float32) for _ in range(2)]
        self.out = [torch.empty(shape, dtype=torch.uint8) for _ in range(2)]

    def __call__(self, index: int) -> np.ndarray:
        # inference mode is per thread: the worker takes it so that it may write into buffers
        # (and read frames) made under the caller's
        with torch.inference_mode():
            return self._convert(index)

    def _convert(self, index: int) -> np.ndarray:
        if self.frame_ready is not None:
            self.frame_ready(index)
        frame = self.frames[index].cpu()
        if frame.dtype == torch.uint8:
            return _pad_to_even(frame.numpy())
        work, out = self.work[index % 2], self.out[index % 2]
        if frame.dtype == torch.float32:
            torch.nan_to_num(frame, 0.0, out=work)
        else:
            work.copy_(frame).nan_to_num_(0.0)
        work.clamp_(0, 1).mul_(255).round_()
        out.copy_(work)  # the cast of .to(torch.uint8)
        return _pad_to_even(out.numpy())


def _converted_ahead(frames: torch.Tensor, frame_ready=None) -> Iterator[np.ndarray]:
    from concurrent.futures import ThreadPoolExecutor

    convert = _FrameConverter(frames, frame_ready)
    with ThreadPoolExecutor(1, thread_name_prefix="wan-video-frames") as pool:
        pending = pool.submit(convert, 0)
        for index in range(1, frames.shape[0] + 1):
            rgb = pending.result()
            # frame index + 1 goes into the other buffers while this one is encoded
            pending = pool.submit(convert, index) if index < frames.shape[0] else None
            yield rgb


def _to_uint8(frame) -> np.ndarray:
    frame = torch.as_tensor(frame).detach().cpu()
    if frame.ndim != 3 or frame.shape[-1] != 3:
        raise ValueError(f"expected a frame [H,W,3] (RGB), got shape {tuple(frame.shape)}")
    if frame.dtype != torch.uint8:
        # nan_to_num copies this one frame; the in-place steps then work on that copy.
        frame = frame.float().nan_to_num(0.0).clamp_(0, 1).mul_(255).round_().to(torch.uint8)
    return frame.numpy()


def _pad_to_even(rgb: np.ndarray) -> np.ndarray:
    # yuv420p stores colour for 2x2 pixel blocks, so H.264 needs even sides: repeat the last
    # row/column (invisible, unlike a black edge). The video is then one pixel larger.
    height, width = rgb.shape[:2]
    if height % 2 == 0 and width % 2 == 0:
        return np.ascontiguousarray(rgb)
    return np.pad(rgb, ((0, height % 2), (0, width % 2), (0, 0)), mode="edge")


def _frame_rate(fps) -> Fraction:
    try:  # numpy scalars are not all floats for Fraction; 23.976 and 29.97 stay exact enough
        rate = Fraction(fps if isinstance(fps, int) else float(fps)).limit_denominator(1001)
    except (TypeError, ValueError, OverflowError):
        raise ValueError(f"fps must be a number, got {fps!r}") from None
    if rate <= 0:
        raise ValueError(f"fps must be positive, got {fps!r}")
    return rate


