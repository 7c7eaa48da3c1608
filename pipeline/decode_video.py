"""Decoding a latent and writing it as an MP4 at once: the encoder, in another thread, takes each
frame as soon as the decode has made it final, so the video is written while the decode goes on.

The file is the one that decoding first and then save_mp4 on the frames would write (the same
frames, converted and encoded in the same order with the same settings). Nothing appears under
the final name unless the decode and the write both complete: an interrupt, an out-of-memory
error or a failed write leaves no file (save_mp4 writes under a temporary name).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Callable

import torch

from .decode import decode
from .handles import WanVAEHandle
from .video_io import check_video_settings, default_h264_encoder, save_mp4


class WriteStopped(Exception):
    """The decode ended before the video's frames were final: the write stops, leaving no file."""


class StreamedWrite:
    """A vae_tiling.decode.FrameListener that encodes the decode's output as it becomes final.

    started() begins a write of the output tensor in a thread; each frame is read once final()
    has covered it. If the decode starts over (a smaller tile budget after running out of
    memory), the earlier write is stopped and its partial file removed first."""

    def __init__(self, path: Path, fps: float, crf: int, tag: str | None = None,
                 encoder: str | None = None) -> None:
        self.path, self.fps, self.crf, self.tag = Path(path), fps, crf, tag
        self.encoder = encoder
        self._changed = threading.Condition()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._final = 0  # frames of each batch item that are final
        self._frames = 1  # frames a batch item
        self._stopped = False

    # -- the decode's side (FrameListener) ------------------------------------------------------

    def started(self, images: torch.Tensor, frames: int) -> None:
        self.stop()
        with self._changed:
            self._final, self._frames, self._stopped, self._error = 0, frames, False, None
        self._thread = threading.Thread(target=self._write, args=(images,), daemon=True,
                                        name="wan-video-write")
        self._thread.start()

    def final(self, frames: int) -> None:
        with self._changed:
            self._final = max(self._final, frames)
            self._changed.notify_all()
        if self._error is not None:  # the write failed: no use decoding on
            raise self._error

    # -- the caller's side ----------------------------------------------------------------------

    def stop(self) -> None:
        """Ends the write without a file (the decode failed or starts over)."""
        if self._thread is None:
            return
        with self._changed:
            self._stopped = True
            self._changed.notify_all()
        self._thread.join()
        self._thread = None

    def finish(self) -> Path:
        """Waits for the write (every frame must have been made final) and returns the path;
        the write's error, if it failed."""
        if self._thread is None:
            raise RuntimeError("the decode never started the video write")
        if self._final < self._frames:
            self.stop()
            raise WriteStopped(f"{self.path.name}: the decode made {self._final} of "
                               f"{self._frames} frames final")
        self._thread.join()
        self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        return self.path

    # -- the writer thread ----------------------------------------------------------------------

    def _frame_ready(self, index: int) -> None:
        frame = index % self._frames  # video frame `index` is this frame of its batch item
        with self._changed:
            self._changed.wait_for(lambda: self._stopped or frame < self._final)
            if self._stopped:
                raise WriteStopped(f"{self.path.name}: the decode stopped")

    def _write(self, images: torch.Tensor) -> None:
        try:  # (save_mp4 reads an inference tensor from any thread: _FrameConverter)
            save_mp4(images, self.path, fps=self.fps, crf=self.crf, encoder=self.encoder,
                     tag=self.tag, replace=False, frame_ready=self._frame_ready)
        except BaseException as error:  # handed to the caller's thread by finish()
            self._error = error


def decode_and_save(vae: WanVAEHandle, latent: dict, path: str | Path, *, fps: float, crf: int,
                    tag: str | None = None, decoded: Callable[[], None] | None = None,
                    **decode_options) -> torch.Tensor:
    """pipeline.decode.decode(vae, latent, **decode_options) with its frames written to `path`
    (an H.264 MP4, as save_mp4(frames, path, fps, crf, tag=tag, replace=False) writes it) while
    it decodes; returns the frames. fps and crf are checked before anything is decoded.
    decoded(): called when the decode is done and the write goes on."""
    check_video_settings(fps, crf)
    write = StreamedWrite(Path(path), fps, crf, tag, encoder=default_h264_encoder())
    try:
        images = decode(vae, latent, listener=write, **decode_options)
        if decoded is not None:
            decoded()
    except BaseException:
        write.stop()
        raise
    write.finish()
    return images
