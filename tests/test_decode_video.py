"""Wan Decode and Save Video: the video written while it decodes is the file that decoding and
then saving writes, and a decode or a write that stops leaves no file."""

import os

import pytest
import torch

from wan_enhanced import host
from wan_enhanced.nodes import NODE_CLASS_MAPPINGS as NODES
from wan_enhanced.pipeline import decode_video, video_io
from wan_enhanced.pipeline.decode_video import StreamedWrite, WriteStopped
from wan_enhanced.vae_tiling.decode import decode_to_images, plan_tiles

from tiny_sets import NAMES

TILED = dict(tile_x=32, tile_y=32, stride_x=16, stride_y=16, mode="tiled")
UNTILED = dict(tile_x=272, tile_y=272, stride_x=144, stride_y=128, mode="untiled")


def node(name):
    return NODES[f"WanEnhanced{name}"]()


@pytest.fixture(scope="module")
def vae(all_kinds_models):
    host.set_headless_folders(models=all_kinds_models)
    (handle,) = node("VAELoader").load(NAMES["ti2v"][1], "fp32")
    yield handle
    host.set_headless_folders(models="models")


@pytest.fixture
def out(tmp_path):
    host.set_headless_folders(output=tmp_path)
    yield tmp_path
    host.set_headless_folders(output="output")


def latent(seed=0, frames=3, side=3):
    generator = torch.Generator().manual_seed(seed)
    return {"samples": torch.randn(1, 48, frames, side, side, generator=generator)}


def files(folder):
    return sorted(p.name for p in folder.rglob("*") if p.is_file())


@pytest.mark.parametrize("grid", [TILED, UNTILED], ids=["tiled", "untiled"])
def test_the_file_is_the_one_decoding_then_saving_writes(vae, out, grid):
    lat = latent()
    with torch.inference_mode():  # as ComfyUI and our runner run nodes
        result = node("DecodeSaveVideo").run(vae, lat, **grid, filename_prefix="a/clip",
                                             fps=12.0, crf=23)
    (images,) = result["result"]
    (entry,) = result["ui"]["images"]
    streamed = out / entry["subfolder"] / entry["filename"]
    (serial_images,) = node("TiledDecode").run(vae, lat, **grid)
    assert torch.equal(images, serial_images)
    serial = out / "serial.mp4"
    video_io.save_mp4(serial_images, serial, fps=12.0, crf=23, tag=video_io.read_tag(streamed))
    assert video_io.read_tag(streamed) is not None
    assert streamed.read_bytes() == serial.read_bytes()
    assert files(out) == ["clip_00001.mp4", "serial.mp4"]


def test_frames_are_final_when_the_listener_is_told(vae):
    lat = latent(1, frames=4)["samples"]

    class Recorder:
        def started(self, images, frames):
            self.images, self.frames, self.seen = images, frames, []

        def final(self, frames):
            self.seen.append((frames, self.images[:frames].clone()))

    recorder = Recorder()
    grid = plan_tiles(3, 3, 16, (32, 32), (16, 16))
    assert len(grid) > 1
    images = decode_to_images(vae.model, lat, grid=grid, listener=recorder)
    counts = [count for count, _ in recorder.seen]
    assert recorder.frames == images.shape[0] == 13
    assert counts == sorted(counts) and counts[-1] == 13 and len(counts) == 4  # one per chunk
    for count, snapshot in recorder.seen:  # never written again once told
        assert torch.equal(snapshot, images[:count])


def test_an_interrupt_during_the_decode_leaves_no_file(vae, out, monkeypatch):
    calls = []

    def interrupt():
        calls.append(1)
        if len(calls) == 10:  # during the last tile: frames are being written
            raise KeyboardInterrupt

    monkeypatch.setattr(host, "check_interrupt", interrupt)
    with pytest.raises(KeyboardInterrupt):
        node("DecodeSaveVideo").run(vae, latent(), **TILED, filename_prefix="clip", fps=8.0,
                                    crf=23)
    assert files(out) == []


def test_a_failed_write_stops_and_names_its_error(vae, out, monkeypatch):
    def broken(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(video_io, "_add_stream", broken)
    with pytest.raises(OSError, match="No space left"):
        node("DecodeSaveVideo").run(vae, latent(), **TILED, filename_prefix="clip", fps=8.0,
                                    crf=23)
    assert files(out) == []


def test_bad_video_settings_are_refused_before_decoding(vae, out, monkeypatch):
    def never(*args, **kwargs):
        raise AssertionError("decoded")

    monkeypatch.setattr(decode_video, "decode", never)
    with pytest.raises(ValueError, match="crf"):
        decode_video.decode_and_save(vae, latent(), out / "x.mp4", fps=8.0, crf=60)
    with pytest.raises(ValueError, match="fps"):
        decode_video.decode_and_save(vae, latent(), out / "x.mp4", fps=0.0, crf=20)
    assert files(out) == []


def test_a_decode_that_starts_over_writes_only_its_last_attempt(out):
    first = torch.rand(5, 32, 32, 3, generator=torch.Generator().manual_seed(1))
    second = torch.rand(5, 32, 32, 3, generator=torch.Generator().manual_seed(2))
    write = StreamedWrite(out / "v.mp4", 8.0, 23, tag="t")
    write.started(first, 5)
    write.final(2)
    write.started(second, 5)  # as after an out-of-memory error, with a smaller grid
    write.final(5)
    assert write.finish() == out / "v.mp4"
    video_io.save_mp4(second, out / "w.mp4", fps=8.0, crf=23, tag="t")
    assert (out / "v.mp4").read_bytes() == (out / "w.mp4").read_bytes()
    assert files(out) == ["v.mp4", "w.mp4"]


def test_a_write_whose_frames_never_became_final_is_stopped(out):
    write = StreamedWrite(out / "v.mp4", 8.0, 23)
    write.started(torch.rand(5, 32, 32, 3), 5)
    write.final(3)
    with pytest.raises(WriteStopped, match="3 of 5"):
        write.finish()
    assert files(out) == []


def test_validation_is_both_nodes(out):
    cls = NODES["WanEnhancedDecodeSaveVideo"]
    assert cls.VALIDATE_INPUTS(**TILED, filename_prefix="ok", fps=16.0) is True
    bad = cls.VALIDATE_INPUTS(**{**TILED, "stride_x": 32}, filename_prefix="../x", fps=float("nan"))
    lines = bad.splitlines()
    assert any(line.startswith("stride_x:") for line in lines)
    assert any(line.startswith("filename_prefix:") for line in lines)
    assert any(line.startswith("fps:") for line in lines)
    assert os.listdir(out) == []
