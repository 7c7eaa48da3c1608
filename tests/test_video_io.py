"""MP4 writing: round trip, odd sizes, input kinds, numbered names, and nothing half-written."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from wan_enhanced.pipeline import video_io
from wan_enhanced.pipeline.video_io import next_output_path, read_mp4, save_mp4


def gradient_video(frames=6, height=48, width=64) -> torch.Tensor:
    """A smooth IMAGE [F,H,W,3] float 0..1 that moves from frame to frame."""
    t = torch.arange(frames).view(-1, 1, 1) / frames
    y = torch.linspace(0, 1, height).view(1, -1, 1)
    x = torch.linspace(0, 1, width).view(1, 1, -1)
    red = (x + 0.1 * t).clamp(0, 1).expand(frames, height, width)
    green = y.expand(frames, height, width)
    blue = (0.5 * (x + y) * (1 - 0.5 * t)).expand(frames, height, width)
    return torch.stack([red, green, blue], dim=-1).contiguous()


def mean_error_255(decoded: torch.Tensor, video: torch.Tensor) -> float:
    return float((decoded.float() - video * 255).abs().mean())


def test_round_trip_keeps_count_size_fps_and_pixels(tmp_path):
    video = gradient_video()
    path = save_mp4(video, tmp_path / "clip.mp4", fps=16, crf=12)
    assert path == tmp_path / "clip.mp4"
    decoded, fps = read_mp4(path)
    assert decoded.dtype == torch.uint8
    assert tuple(decoded.shape) == (6, 48, 64, 3)
    assert fps == 16
    assert mean_error_255(decoded, video) < 3
    assert os.listdir(tmp_path) == ["clip.mp4"]


def test_the_same_frames_give_the_same_file_every_time(tmp_path):
    """One seed, one video: small noisy clips (what a small model's preview decodes to) are
    where x264's macroblock-tree rate control made encodes of the same frames differ."""
    if video_io.default_h264_encoder() != "libx264":
        pytest.skip("the encoder here is not libx264")
    gen = torch.Generator().manual_seed(0)
    noise = torch.rand(17, 3, 24, 40, generator=gen)  # the demo's 320x192x17
    frames = torch.nn.functional.interpolate(noise, size=(192, 320), mode="bilinear")
    frames = frames.permute(0, 2, 3, 1).contiguous()
    files = [save_mp4(frames, tmp_path / f"{i}.mp4", fps=24, crf=19).read_bytes()
             for i in range(10)]
    assert all(f == files[0] for f in files)


def test_fractional_frame_rate_and_default_quality(tmp_path):
    video = gradient_video(frames=4)
    _, fps = read_mp4(save_mp4(video, tmp_path / "clip.mp4", fps=23.976))
    assert fps == pytest.approx(23.976, abs=1e-3)


def test_higher_crf_gives_a_smaller_file(tmp_path):
    noise = torch.rand(4, 32, 32, 3, generator=torch.Generator().manual_seed(0))
    fine = save_mp4(noise, tmp_path / "fine.mp4", crf=10).stat().st_size
    coarse = save_mp4(noise, tmp_path / "coarse.mp4", crf=40).stat().st_size
    assert coarse < fine


@pytest.mark.parametrize("height, width", [(47, 63), (48, 63), (47, 64)])
def test_odd_sizes_are_padded_to_even_by_repeating_the_edge(tmp_path, height, width):
    video = gradient_video(frames=3, height=height, width=width)
    decoded, _ = read_mp4(save_mp4(video, tmp_path / "odd.mp4", crf=12))
    assert tuple(decoded.shape) == (3, height + height % 2, width + width % 2, 3)
    assert mean_error_255(decoded[:, :height, :width], video) < 3
    # the added column/row repeats its neighbour, so it is no darker than the picture
    assert abs(float(decoded[:, :, -1].float().mean() - decoded[:, :, -2].float().mean())) < 4


def test_uint8_tensor_numpy_and_generator_inputs(tmp_path):
    video = gradient_video(frames=3)
    as_uint8 = (video * 255).round().to(torch.uint8)
    from_float = read_mp4(save_mp4(video, tmp_path / "float.mp4"))[0]
    from_uint8 = read_mp4(save_mp4(as_uint8, tmp_path / "uint8.mp4"))[0]
    from_numpy = read_mp4(save_mp4(as_uint8.numpy(), tmp_path / "numpy.mp4"))[0]
    from_frames = read_mp4(save_mp4((frame for frame in video), tmp_path / "frames.mp4"))[0]
    assert torch.equal(from_float, from_uint8)
    assert torch.equal(from_float, from_numpy)
    assert torch.equal(from_float, from_frames)


def test_out_of_range_values_are_clamped(tmp_path):
    video = gradient_video(frames=2) * 3 - 1
    video[0, 0, 0, 0] = float("nan")
    decoded, _ = read_mp4(save_mp4(video, tmp_path / "clamped.mp4", crf=12))
    assert mean_error_255(decoded, video.nan_to_num(0).clamp(0, 1)) < 4


def test_encoder_without_crf_mode_gets_a_bit_rate(tmp_path):
    # "h264" names the default H.264 encoder but takes the generic bit-rate branch.
    video = gradient_video(frames=3)
    path = save_mp4(video, tmp_path / "rate.mp4", encoder="h264")
    decoded, _ = read_mp4(path)
    assert decoded.shape[0] == 3
    # a bit rate high enough for the picture to survive (a missing rate gives mush)
    assert mean_error_255(decoded, video) < 6
    import av
    with av.open(str(path)) as container:
        assert container.streams.video[0].bit_rate > 0


# -- numbered names ----------------------------------------------------------------------------

def test_numbering_continues_and_never_overwrites(tmp_path):
    first = next_output_path(tmp_path, "clip")
    assert first == tmp_path / "clip_00001.mp4"
    assert next_output_path(tmp_path, "clip") == first  # nothing written yet
    save_mp4(gradient_video(frames=2), first)
    assert next_output_path(tmp_path, "clip") == tmp_path / "clip_00002.mp4"
    (tmp_path / "clip_00007_.png").write_bytes(b"")  # ComfyUI's own image naming
    (tmp_path / "clip2_00050.mp4").write_bytes(b"")  # another prefix
    (tmp_path / "clip_notes.txt").write_bytes(b"")
    assert next_output_path(tmp_path, "clip") == tmp_path / "clip_00008.mp4"
    assert next_output_path(tmp_path, "clip", ext="png") == tmp_path / "clip_00008.png"
    (tmp_path / ".clip_00008.mp4.1a2b3c4d.partial").write_bytes(b"")  # still being written
    assert next_output_path(tmp_path, "clip") == tmp_path / "clip_00009.mp4"


def test_prefix_with_subfolder(tmp_path):
    path = next_output_path(tmp_path, "wan/clip")
    assert path == tmp_path / "wan" / "clip_00001.mp4"
    assert path.parent.is_dir()
    save_mp4(gradient_video(frames=2), path)
    assert next_output_path(tmp_path, "wan/clip").name == "clip_00002.mp4"
    assert next_output_path(tmp_path, "clip").name == "clip_00001.mp4"


def test_prefix_cannot_leave_the_output_folder(tmp_path):
    with pytest.raises(ValueError, match="outside"):
        next_output_path(tmp_path / "out", "../elsewhere/clip")
    with pytest.raises(ValueError, match="empty"):
        next_output_path(tmp_path, "wan/")


# -- failures leave nothing --------------------------------------------------------------------

def test_missing_folder_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing"):
        save_mp4(gradient_video(frames=2), tmp_path / "missing" / "clip.mp4")


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0,
                    reason="file modes do not stop root")
def test_read_only_folder_raises_and_leaves_nothing(tmp_path):
    folder = tmp_path / "locked"
    folder.mkdir()
    folder.chmod(0o555)
    try:
        with pytest.raises(PermissionError, match="locked"):
            save_mp4(gradient_video(frames=2), folder / "clip.mp4")
        assert os.listdir(folder) == []
    finally:
        folder.chmod(0o755)


def test_unwritable_folder_raises_naming_it_and_leaves_nothing(tmp_path, monkeypatch):
    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(video_io.os, "open", refuse)
    with pytest.raises(PermissionError, match=str(tmp_path)):
        save_mp4(gradient_video(frames=2), tmp_path / "clip.mp4")
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("error", [RuntimeError("decoder failed"), KeyboardInterrupt()])
def test_failure_mid_encode_leaves_no_file(tmp_path, error):
    def frames_then_failure():
        yield from gradient_video(frames=3)
        raise error

    with pytest.raises(type(error)):
        save_mp4(frames_then_failure(), tmp_path / "clip.mp4")
    assert os.listdir(tmp_path) == []


def test_failed_write_keeps_the_previous_file(tmp_path):
    path = save_mp4(gradient_video(frames=2), tmp_path / "clip.mp4")
    before = path.read_bytes()
    with pytest.raises(ValueError, match="frame 1"):
        save_mp4([torch.zeros(16, 16, 3), torch.zeros(15, 15, 3)], path)  # pads to 16x16
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["clip.mp4"]


@pytest.mark.parametrize("frames, options, message", [
    ([], {}, "no frames"),
    (torch.zeros(2, 8, 8, 4), {}, r"\[H,W,3\]"),
    (torch.zeros(8, 8, 3), {}, r"\[F,H,W,3\]"),
    (torch.zeros(2, 8, 8, 3), {"crf": 60}, "crf"),
    (torch.zeros(2, 8, 8, 3), {"fps": 0}, "fps"),
])
def test_bad_input_is_refused_and_leaves_nothing(tmp_path, frames, options, message):
    with pytest.raises(ValueError, match=message):
        save_mp4(frames, tmp_path / "clip.mp4", **options)
    assert os.listdir(tmp_path) == []


def test_read_mp4_returns_numpy_compatible_frames(tmp_path):
    decoded, _ = read_mp4(save_mp4(np.zeros((2, 8, 8, 3), np.uint8), tmp_path / "black.mp4"))
    assert decoded.numpy().max() <= 20  # black stays black (limited-range decoding is right)


def test_a_tensors_frames_converted_ahead_give_the_same_file_as_one_by_one(tmp_path):
    """The IMAGE tensor path (frames converted one ahead in a worker thread into reused
    buffers) writes the very file the frame-by-frame path writes: NaN, values out of 0..1, odd
    sizes and half-precision frames included."""
    gen = torch.Generator().manual_seed(5)
    frames = torch.rand(6, 35, 49, 3, generator=gen) * 1.2 - 0.1
    frames[1, 2, 3, 0] = float("nan")
    frames[2, 4, 5, 1] = float("inf")
    for name, video in (("float32", frames), ("bf16", frames.to(torch.bfloat16))):
        whole = save_mp4(video, tmp_path / f"{name}_whole.mp4", fps=8)
        one_by_one = save_mp4(list(video), tmp_path / f"{name}_frames.mp4", fps=8)
        assert whole.read_bytes() == one_by_one.read_bytes(), name
    decoded, _ = read_mp4(tmp_path / "float32_whole.mp4")
    assert decoded.shape == (6, 36, 50, 3)


def test_frames_made_under_inference_mode_are_written(tmp_path):
    """Nodes run under torch.inference_mode: the worker thread converting the frames must be
    able to read them and fill its buffers (inference mode is per thread)."""
    with torch.inference_mode():
        frames = torch.rand(4, 16, 16, 3)
        path = save_mp4(frames, tmp_path / "inference.mp4", fps=8)
    with torch.inference_mode():
        again = save_mp4(list(frames), tmp_path / "frames.mp4", fps=8)
    assert path.read_bytes() == again.read_bytes()


def test_comfyuis_filename_variables_are_expanded_as_its_savers_do(tmp_path):
    import time

    from wan_enhanced import host
    from wan_enhanced.nodes.video import WanSaveVideo
    from wan_enhanced.pipeline.video_io import expand_filename_variables

    moment = time.struct_time((2026, 3, 7, 9, 5, 2, 5, 66, 0))
    assert expand_filename_variables("wan/%year%-%month%-%day%/%hour%%minute%%second%_%width%x"
                                     "%height%", 1280, 704, moment) == \
        "wan/2026-03-07/090502_1280x704"
    assert expand_filename_variables("plain/name", 1, 2, moment) == "plain/name"
    assert expand_filename_variables("%unknown%", 1, 2, moment) == "%unknown%"
    host.set_headless_folders(output=tmp_path)
    try:
        WanSaveVideo().save(torch.zeros(2, 24, 40, 3), "clips/%width%x%height%", 8.0, 23)
    finally:
        host.set_headless_folders(output="output")
    assert [p.name for p in (tmp_path / "clips").iterdir()] == ["40x24_00001.mp4"]
