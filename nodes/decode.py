"""The tiled decode node (with a plain untiled mode)."""

from __future__ import annotations

from .. import host
from ..pipeline.decode import decode
from .common import CATEGORY, memory_event, node_errors


class WanTiledDecode:
    DISPLAY = "Wan Tiled Decode"

    @classmethod
    def INPUT_TYPES(cls):
        pixels = {"min": 16, "max": 4096, "step": 16}
        return {"required": {
            "vae": ("WANVAE",),
            "latent": ("LATENT",),
            "tile_x": ("INT", {"default": 272, **pixels}),
            "tile_y": ("INT", {"default": 272, **pixels}),
            "stride_x": ("INT", {"default": 144, **pixels}),
            "stride_y": ("INT", {"default": 128, **pixels}),
            "mode": (["tiled", "untiled"], {"default": "tiled"}),
        }, "hidden": {"unique_id": "UNIQUE_ID"}}

    RETURN_TYPES = ("IMAGE",)
    FUNCTION = "run"
    CATEGORY = CATEGORY

    def run(self, vae, latent, tile_x, tile_y, stride_x, stride_y, mode, unique_id=None):
        memory_event("decode starts", "decode", unique_id)
        bar = None

        def progress(done: int, total: int) -> None:
            nonlocal bar
            bar = bar or host.Progress(total, self.DISPLAY)
            bar.update_to(done)

        with node_errors(self.DISPLAY):
            images = decode(vae, latent, tiled=mode == "tiled", tile=(tile_x, tile_y),
                            stride=(stride_x, stride_y), progress=progress)
        memory_event("decode done", "decode", unique_id)
        return (images,)
