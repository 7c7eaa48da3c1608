"""Decoding a latent straight to an MP4: the video is written while it decodes."""

from __future__ import annotations

from .. import host
from ..pipeline.decode import check_latent_for_vae
from ..pipeline.decode_video import decode_and_save
from ..pipeline.video_io import claim_output_path, expand_filename_variables
from .checks import verdict
from .common import CATEGORY, DECODE_DONE, memory_event, node_errors, progress_bar
from .decode import WanTiledDecode
from .video import WanSaveVideo, saved_video_ui


class WanDecodeSaveVideo:
    """Wan Tiled Decode and Wan Save Video in one node; the same frames and the same file, with
    the encoding done while the decode runs instead of after it."""

    DISPLAY = "Wan Decode and Save Video"

    @classmethod
    def INPUT_TYPES(cls):
        decode, save = WanTiledDecode.INPUT_TYPES(), WanSaveVideo.INPUT_TYPES()
        required = {**decode["required"],
                    **{k: v for k, v in save["required"].items() if k != "images"}}
        return {"required": required, "optional": decode["optional"],
                "hidden": {"unique_id": "UNIQUE_ID"}}

    RETURN_TYPES = ("IMAGE",)
    FUNCTION = "run"
    CATEGORY = CATEGORY
    OUTPUT_NODE = True

    @classmethod
    def VALIDATE_INPUTS(cls, tile_x, tile_y, stride_x, stride_y, mode, filename_prefix, fps,
                        vram_budget_gb=None):
        """Both nodes' checks."""
        verdicts = [WanTiledDecode.VALIDATE_INPUTS(tile_x, tile_y, stride_x, stride_y, mode,
                                                   vram_budget_gb),
                    WanSaveVideo.VALIDATE_INPUTS(filename_prefix, fps)]
        return verdict(v for v in verdicts if v is not True)

    def run(self, vae, latent, tile_x, tile_y, stride_x, stride_y, mode, filename_prefix, fps,
            crf, vram_budget_gb=3.0, overlap=64, unique_id=None):
        root = host.output_directory()
        memory_event("decode starts", "decode", unique_id)
        with node_errors(self.DISPLAY):
            samples = check_latent_for_vae(vae, latent)
            height, width = (side * vae.model.spatial_stride for side in samples.shape[-2:])
            prefix = expand_filename_variables(filename_prefix, width, height)
            claimed = claim_output_path(root, prefix)  # no other writer takes it
            try:
                path = claimed.path
                host.announce_output(unique_id, path, claimed.token)
                images = decode_and_save(
                    vae, latent, path, fps=fps, crf=crf, tag=claimed.token, mode=mode,
                    tile=(tile_x, tile_y), stride=(stride_x, stride_y),
                    budget_gb=vram_budget_gb, overlap=overlap,
                    progress=progress_bar(self.DISPLAY),
                    decoded=lambda: memory_event(DECODE_DONE, "decode", unique_id))
            finally:
                claimed.release()
        memory_event(f"saved {path.name}", "save", unique_id)
        return {"ui": saved_video_ui(root, path), "result": (images,)}
