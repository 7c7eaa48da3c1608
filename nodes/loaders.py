"""Loader nodes: model, text encoder, VAE. Each loads to the CPU; the computing node places it."""

from __future__ import annotations

import collections

from .. import host
from ..pipeline import loading
from ..pipeline.model_files import loader_file_problem
from ..pipeline.placement import tensor_bytes
from ..wan.attention import available_backends
from .checks import verdict
from .common import CATEGORY, memory_event, node_errors

HIDDEN = {"unique_id": "UNIQUE_ID"}
OPTIONAL = {"keep_on_gpu": ("BOOLEAN", {"default": False, "tooltip": "keep the model on the GPU "
                                        "between nodes and runs instead of offloading it"})}
COMPILE = ("BOOLEAN", {"default": False, "tooltip": "torch.compile the transformer blocks: "
                       "about 3% less time per step on an H100, but the first step of each new "
                       "process and video size takes 7-15 s more; pays off only over many "
                       "steps of one size in one ComfyUI process (needs Triton)"})

DTYPE = ("auto: bf16 on a GPU, fp32 on a CPU (a CPU runs bf16 and fp16 many times slower than "
         "fp32); or bf16/fp16/fp32 as chosen")
TEXT_DTYPE = ("auto: bf16 on a GPU, fp32 on a CPU; an fp8 file (ComfyUI's umt5 fp8 scaled) keeps "
              "its fp8 weights and computes in fp32 everywhere; or bf16/fp16/fp32 as chosen")
WEIGHT_DTYPE = ("how the weights are stored: auto (bf16 on a GPU, fp32 on a CPU, where bf16 runs "
                "many times slower), bf16/fp16/fp32; or the transformer blocks' "
                "matrices quantized (the rest bf16): fp8_e4m3fn (fp8 weights, dequantized per "
                "matmul), fp8_e4m3fn_fast (fp8 matmul, GPUs of compute capability 8.9+), int8 "
                "(int8 weights), int8_dynamic (int8 weights and activations). fp8 files load as "
                "they are with the fp8 choices")


def _file_choice(folder: str):
    return (host.list_models(folder), {"tooltip": f"a file of the '{folder}' models folder "
                                                  f"(an absolute path only with the "
                                                  f"wan-enhanced command line)"})


def _loaded_event(handle, component: str, unique_id) -> None:
    """The load event, attributed: which component, and how much it occupies once placed."""
    quantization = getattr(getattr(handle, "info", None), "quantization", None)
    extra = {"quantization": quantization} if quantization else {}
    memory_event(f"loaded {handle.name}", "load", unique_id, component=component,
                 bytes=tensor_bytes(handle.model), dtype=_main_dtype(handle.model),
                 file=handle.name, **extra)


def _main_dtype(module) -> str | None:
    """The dtype holding most of the module's bytes (quantized models keep scales and norms in
    other dtypes)."""
    sizes = collections.Counter()
    for tensor in list(module.parameters()) + list(module.buffers()):
        sizes[tensor.dtype] += tensor.numel() * tensor.element_size()
    if not sizes:
        return None
    return str(sizes.most_common(1)[0][0]).removeprefix("torch.")


def _validate_file(folder: str, name: str, field: str):
    """True for a file of the folder that holds the kind of model the loader makes (inside
    ComfyUI only names from the folder; headless also an absolute path); else the reason."""
    return verdict([loader_file_problem(folder, name, field)])

ATTENTION = ("attention kernel: auto (the fastest for the weights: fp8 attention with "
             "fp8_e4m3fn_fast; otherwise exact attention, bf16_hopper on Hopper GPUs, cuDNN "
             "SDPA elsewhere), sdpa, sdpa_cudnn, bf16_hopper (our exact kernel: Hopper GPUs "
             "with Triton; elsewhere SDPA with a warning), fp8_triton (our fp8 kernel: "
             "Ada/Hopper GPUs with Triton, about 1/1000 error; elsewhere SDPA with a warning), "
             "flash_attn / sageattention when installed")


class WanModelLoader:
    DISPLAY = "Wan Model Loader"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "model_name": _file_choice("diffusion_models"),
            "weight_dtype": (loading.MODEL_DTYPES, {"default": "auto", "tooltip": WEIGHT_DTYPE}),
            "attention": (available_backends(), {"default": "auto", "tooltip": ATTENTION}),
        }, "optional": {**OPTIONAL, "compile": COMPILE}, "hidden": HIDDEN}

    RETURN_TYPES = ("WANMODEL",)
    RETURN_NAMES = ("model",)
    FUNCTION = "load"
    CATEGORY = CATEGORY

    @classmethod
    def VALIDATE_INPUTS(cls, model_name):
        return _validate_file("diffusion_models", model_name, "model_name")

    def load(self, model_name, weight_dtype, attention, keep_on_gpu=False, compile=False,
             unique_id=None):
        with node_errors(self.DISPLAY):
            handle = loading.load_model(host.resolve_model("diffusion_models", model_name),
                                        weight_dtype, attention, keep_on_gpu, compile)
        _loaded_event(handle, "dit", unique_id)
        return (handle,)


class WanTextEncoderLoader:
    DISPLAY = "Wan Text Encoder Loader"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "text_encoder_name": _file_choice("text_encoders"),
            "dtype": (loading.FLOAT_CHOICES, {"default": "auto", "tooltip": TEXT_DTYPE}),
            "device": (["gpu", "cpu"], {"default": "gpu",
                                        "tooltip": "where the encoder runs: gpu uses the GPU "
                                                   "when there is one, else the CPU"}),
        }, "optional": OPTIONAL, "hidden": HIDDEN}

    RETURN_TYPES = ("WANTEXTENCODER",)
    RETURN_NAMES = ("text_encoder",)
    FUNCTION = "load"
    CATEGORY = CATEGORY

    @classmethod
    def VALIDATE_INPUTS(cls, text_encoder_name):
        return _validate_file("text_encoders", text_encoder_name, "text_encoder_name")

    def load(self, text_encoder_name, dtype, device, keep_on_gpu=False, unique_id=None):
        with node_errors(self.DISPLAY):
            handle = loading.load_text_encoder_handle(
                host.resolve_model("text_encoders", text_encoder_name), dtype, device,
                keep_on_gpu)
        _loaded_event(handle, "text_encoder", unique_id)
        return (handle,)


class WanVAELoader:
    DISPLAY = "Wan VAE Loader"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "vae_name": _file_choice("vae"),
            "dtype": (loading.FLOAT_CHOICES, {"default": "auto", "tooltip": DTYPE}),
        }, "optional": OPTIONAL, "hidden": HIDDEN}

    RETURN_TYPES = ("WANVAE",)
    RETURN_NAMES = ("vae",)
    FUNCTION = "load"
    CATEGORY = CATEGORY

    @classmethod
    def VALIDATE_INPUTS(cls, vae_name):
        return _validate_file("vae", vae_name, "vae_name")

    def load(self, vae_name, dtype, keep_on_gpu=False, unique_id=None):
        with node_errors(self.DISPLAY):
            handle = loading.load_vae_handle(host.resolve_model("vae", vae_name), dtype,
                                             keep_on_gpu)
        _loaded_event(handle, "vae", unique_id)
        return (handle,)


class WanCLIPVisionLoader:
    DISPLAY = "Wan CLIP Vision Loader"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "clip_name": _file_choice("clip_vision"),
            "dtype": (loading.FLOAT_CHOICES, {"default": "auto", "tooltip": DTYPE}),
        }, "hidden": HIDDEN}

    RETURN_TYPES = ("WANCLIPVISION",)
    RETURN_NAMES = ("clip_vision",)
    FUNCTION = "load"
    CATEGORY = CATEGORY

    @classmethod
    def VALIDATE_INPUTS(cls, clip_name):
        return _validate_file("clip_vision", clip_name, "clip_name")

    def load(self, clip_name, dtype, unique_id=None):
        with node_errors(self.DISPLAY):
            handle = loading.load_clip_vision_handle(host.resolve_model("clip_vision", clip_name),
                                                     dtype)
        _loaded_event(handle, "clip_vision", unique_id)
        return (handle,)
