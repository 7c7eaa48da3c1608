"""The tiled decode node: tiles from a memory budget (auto), from a tile size, or none."""

from __future__ import annotations

from ..pipeline.decode import decode
from .checks import constant_problems, verdict
from .common import CATEGORY, DECODE_DONE, memory_event, node_errors, progress_bar


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
            "mode": (["auto", "tiled", "untiled"], {"default": "auto", "tooltip":
                     "tiled: the tile and stride above; untiled: the whole frame at once; "
                     "auto: the grid of least work whose tiles fit vram_budget_gb"}),
        }, "optional": {
            "vram_budget_gb": ("FLOAT", {"default": 3.0, "min": 0.0, "max": 1024.0, "step": 0.25,
                                         "tooltip": "auto: device memory for the decode besides "
                                                    "the VAE's weights; 0 uses what the device "
                                                    "has free once ComfyUI has unloaded what an "
                                                    "untiled decode would need"}),
            "overlap": ("INT", {"default": 64, **pixels, "tooltip":
                                "auto: pixels shared by neighbouring tiles, blended"}),
        }, "hidden": {"unique_id": "UNIQUE_ID"}}

    RETURN_TYPES = ("IMAGE",)
    FUNCTION = "run"
    CATEGORY = CATEGORY

    @classmethod
    def VALIDATE_INPUTS(cls, tile_x, tile_y, stride_x, stride_y, mode, vram_budget_gb=None):
        """The budget is a finite number; in tiled mode tiles overlap (stride below tile)."""
        problems = constant_problems(cls, tile_x=tile_x, tile_y=tile_y, stride_x=stride_x,
                                     stride_y=stride_y, mode=mode, vram_budget_gb=vram_budget_gb)
        if mode == "tiled":
            for axis, tile, stride in (("x", tile_x, stride_x), ("y", tile_y, stride_y)):
                if isinstance(tile, int) and isinstance(stride, int) and stride >= tile:
                    problems.append(f"stride_{axis}: {stride} px must be smaller than tile_{axis} "
                                    f"({tile} px) so that tiles overlap")
        return verdict(problems)

    def run(self, vae, latent, tile_x, tile_y, stride_x, stride_y, mode, vram_budget_gb=3.0,
            overlap=64, unique_id=None):
        memory_event("decode starts", "decode", unique_id)
        with node_errors(self.DISPLAY):
            images = decode(vae, latent, mode=mode, tile=(tile_x, tile_y),
                            stride=(stride_x, stride_y), budget_gb=vram_budget_gb,
                            overlap=overlap, progress=progress_bar(self.DISPLAY))
        memory_event(DECODE_DONE, "decode", unique_id)
        return (images,)
