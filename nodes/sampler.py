"""The sampler node: one model, or the two Wan2.2 A14B experts switched at the boundary."""

from __future__ import annotations


from .. import host
from ..pipeline.sample import SamplerSettings, sample
from ..sampling.solvers import SOLVER_NAMES
from ..sampling.step_cache import CACHE_METHODS
from .checks import constant_problems, verdict
from .common import CATEGORY, memory_event, node_errors


class WanSampler:
    DISPLAY = "Wan Sampler"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "model": ("WANMODEL", {"tooltip": "for Wan2.2 A14B: the high-noise expert"}),
            "positive": ("CONDITIONING",),
            "negative": ("CONDITIONING",),
            "latent": ("LATENT",),
            "seed": ("INT", {"default": 0, "min": 0, "max": 2**53 - 1,
                             "control_after_generate": True}),
            "steps": ("INT", {"default": 30, "min": 1, "max": 1000}),
            "cfg": ("FLOAT", {"default": 5.0, "min": 0.0, "max": 100.0, "step": 0.1}),
            "shift": ("FLOAT", {"default": 5.0, "min": 0.01, "max": 100.0, "step": 0.1}),
            "scheduler": (list(SOLVER_NAMES), {"default": "unipc"}),
            "denoise": ("FLOAT", {"default": 1.0, "min": 0.01, "max": 1.0, "step": 0.01}),
        }, "optional": {
            "low_noise_model": ("WANMODEL", {"tooltip": "Wan2.2 A14B low-noise expert"}),
            "boundary": ("FLOAT", {"default": -1.0, "min": -1.0, "max": 1.0, "step": 0.005,
                                   "tooltip": "A14B: the high-noise expert runs while "
                                              "t >= boundary * 1000; -1 uses the pair's own "
                                              "(T2V 0.875, I2V 0.9)"}),
            "cfg_low_noise": ("FLOAT", {"default": -1.0, "min": -1.0, "max": 100.0,
                                        "step": 0.1, "tooltip": "A14B: guidance of the "
                                        "low-noise expert; -1 uses cfg"}),
            "block_swap": ("INT", {"default": -1, "min": -1, "max": 64, "tooltip":
                                   "transformer blocks kept in pinned CPU memory and streamed "
                                   "to the GPU while the model runs (a side stream copies the "
                                   "next block as one computes): less VRAM, more host RAM "
                                   "traffic; a number above the model's block count swaps all; "
                                   "-1 (default): as few as let the run fit the GPU's free "
                                   "memory, none where the model fits"}),
            "prefetch_blocks": ("INT", {"default": 1, "min": 1, "max": 8, "tooltip":
                                        "block swap: blocks copied ahead of the one computing "
                                        "(each holds one block's weights on the GPU)"}),
            "gpus": ("INT", {"default": 1, "min": 1, "max": 64, "tooltip":
                             "GPUs that compute this video together (1: this process, as "
                             "always). Each step's tokens are split over them (Ulysses or ring "
                             "attention) and, with guidance, the conditional and unconditional "
                             "passes run on two halves at once. A warm process per GPU keeps "
                             "the model between runs"}),
            "fsdp": ("BOOLEAN", {"default": False, "tooltip": "with gpus > 1: shard the "
                                 "transformer blocks over the GPUs (each block gathered just "
                                 "before it computes) instead of a whole copy on each; for a "
                                 "model that does not fit one GPU"}),
            "cache": (list(CACHE_METHODS), {"default": "off", "tooltip":
                      "easycache: a step whose input changed little since the last full "
                      "forward reuses that forward's residual instead of running the model. "
                      "teacache / teacache_ret_steps (Wan2.1) and magcache (Wan2.1, Wan2.2): "
                      "a forward skips the transformer blocks and reuses their last residual, "
                      "as the methods' published Wan code decides with the model's published "
                      "coefficients; a model without them is refused by name. Faster, "
                      "approximate; the log says how much was skipped"}),
            "cache_threshold": ("FLOAT", {"default": -1.0, "min": -1.0, "max": 3.0,
                                          "step": 0.01, "tooltip": "higher skips more; -1 "
                                          "uses the method's default: easycache 0.2, teacache "
                                          "0.2, magcache 0.12 (Wan2.1) / 0.04 (Wan2.2)"}),
        }, "hidden": {"unique_id": "UNIQUE_ID"}}

    RETURN_TYPES = ("LATENT",)
    FUNCTION = "run"
    CATEGORY = CATEGORY

    @classmethod
    def VALIDATE_INPUTS(cls, cfg, shift, denoise, boundary=None, cfg_low_noise=None, gpus=None,
                        cache_threshold=None):
        """No NaN in a FLOAT input (ComfyUI's range checks let NaN through); no more GPUs than
        this machine has."""
        from ..distributed.devices import gpus_problem
        problems = constant_problems(cls, cfg=cfg, shift=shift, denoise=denoise,
                                     boundary=boundary, cfg_low_noise=cfg_low_noise, gpus=gpus,
                                     cache_threshold=cache_threshold)
        return verdict([*problems, gpus_problem(gpus)])

    def run(self, model, positive, negative, latent, seed, steps, cfg, shift, scheduler,
            denoise, low_noise_model=None, boundary=-1.0, cfg_low_noise=-1.0, block_swap=-1,
            prefetch_blocks=1, gpus=1, fsdp=False, cache="off", cache_threshold=-1.0,
            unique_id=None):
        settings = SamplerSettings(seed=seed, steps=steps, cfg=cfg, shift=shift,
                                   scheduler=scheduler, denoise=denoise,
                                   boundary=None if boundary < 0 else boundary,
                                   cfg_low_noise=None if cfg_low_noise < 0 else cfg_low_noise,
                                   block_swap=block_swap, prefetch_blocks=prefetch_blocks,
                                   gpus=gpus, fsdp=fsdp, cache=cache,
                                   cache_threshold=None if cache_threshold == -1
                                   else cache_threshold)
        progress = host.Progress(steps, self.DISPLAY)
        memory_event("sampling starts", "sample", unique_id)

        def step_done(index: int, total: int) -> None:
            progress.update_to(index + 1)
            memory_event(f"step {index + 1}/{total}", "sample", unique_id, step=index + 1)

        with node_errors(self.DISPLAY):
            out = sample(model, positive, negative, latent, settings,
                         low_noise_model=low_noise_model, on_step=step_done)
        memory_event("sampling done", "sample", unique_id)
        return (out,)
