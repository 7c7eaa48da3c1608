"""The CLIP image encoder Wan2.1 image-to-video models attend to (ViT-H/14, 257 tokens of 1280).

Wan2.1 I2V-14B cross-attends to the image's CLIP tokens as well as to the text: the hidden states
after the last-but-one transformer layer (the official `use_31_block`, ComfyUI's penultimate
hidden states), before any final norm. Parameter names follow the layout of ComfyUI's
`clip_vision_h.safetensors` (transformers' CLIPVisionModel: `vision_model.*`);
checkpoints/clip_vision.py also reads the official release's .pth. The projection head is not
used.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

# CLIP's image normalisation (the statistics it was trained with)
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclass(frozen=True)
class CLIPVisionConfig:
    hidden: int = 1280
    layers: int = 32
    heads: int = 16
    intermediate: int = 5120
    image_size: int = 224
    patch: int = 14
    eps: float = 1e-5

    @property
    def tokens(self) -> int:
        return (self.image_size // self.patch) ** 2 + 1


class Embeddings(nn.Module):
    def __init__(self, config: CLIPVisionConfig):
        super().__init__()
        self.class_embedding = nn.Parameter(torch.zeros(config.hidden))
        self.patch_embedding = nn.Conv2d(3, config.hidden, config.patch, config.patch, bias=False)
        self.position_embedding = nn.Embedding(config.tokens, config.hidden)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        patches = self.patch_embedding(pixels).flatten(2).transpose(1, 2)  # [B, N, D]
        cls = self.class_embedding.expand(patches.shape[0], 1, -1).to(patches.dtype)
        return torch.cat([cls, patches], dim=1) + self.position_embedding.weight.to(patches.dtype)


class SelfAttention(nn.Module):
    def __init__(self, config: CLIPVisionConfig):
        super().__init__()
        self.heads = config.heads
        self.q_proj = nn.Linear(config.hidden, config.hidden)
        self.k_proj = nn.Linear(config.hidden, config.hidden)
        self.v_proj = nn.Linear(config.hidden, config.hidden)
        self.out_proj = nn.Linear(config.hidden, config.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape

        def heads(t):
            return t.view(b, n, self.heads, d // self.heads).transpose(1, 2)

        out = F.scaled_dot_product_attention(heads(self.q_proj(x)), heads(self.k_proj(x)),
                                             heads(self.v_proj(x)))
        return self.out_proj(out.transpose(1, 2).reshape(b, n, d))


class MLP(nn.Module):
    def __init__(self, config: CLIPVisionConfig):
        super().__init__()
        self.fc1 = nn.Linear(config.hidden, config.intermediate)
        self.fc2 = nn.Linear(config.intermediate, config.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class EncoderLayer(nn.Module):
    """Pre-norm transformer layer: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, config: CLIPVisionConfig):
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(config.hidden, eps=config.eps)
        self.self_attn = SelfAttention(config)
        self.layer_norm2 = nn.LayerNorm(config.hidden, eps=config.eps)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class Encoder(nn.Module):
    def __init__(self, config: CLIPVisionConfig):
        super().__init__()
        self.layers = nn.ModuleList(EncoderLayer(config) for _ in range(config.layers))


class VisionModel(nn.Module):
    def __init__(self, config: CLIPVisionConfig):
        super().__init__()
        self.embeddings = Embeddings(config)
        self.pre_layrnorm = nn.LayerNorm(config.hidden, eps=config.eps)  # (the files' spelling)
        self.encoder = Encoder(config)
        self.post_layernorm = nn.LayerNorm(config.hidden, eps=config.eps)  # unused by Wan


class CLIPVisionEncoder(nn.Module):
    """pixels [B, 3, S, S], CLIP-normalised -> penultimate hidden states [B, tokens, hidden]."""

    def __init__(self, config: CLIPVisionConfig = CLIPVisionConfig()):
        super().__init__()
        self.config = config
        self.vision_model = VisionModel(config)

    @torch.no_grad()
    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        model = self.vision_model
        x = model.pre_layrnorm(model.embeddings(pixels.to(model.pre_layrnorm.weight.dtype)))
        for layer in model.encoder.layers[:-1]:  # the last layer's output is not used
            x = layer(x)
        return x

    def preprocess(self, image: torch.Tensor) -> torch.Tensor:
        """IMAGE [N, H, W, 3] in 0..1 -> [N, 3, S, S]: the shorter side scaled to S (bicubic,
        antialiased), centre-cropped, normalised with CLIP's statistics."""
        size = self.config.image_size
        x = image.permute(0, 3, 1, 2).to(torch.float32)
        h, w = x.shape[2:]
        scale = size / min(h, w)
        scaled = (max(size, round(h * scale)), max(size, round(w * scale)))
        x = F.interpolate(x, size=scaled, mode="bicubic", align_corners=False,
                          antialias=scale < 1).clamp(0, 1)
        top, left = (scaled[0] - size) // 2, (scaled[1] - size) // 2
        x = x[:, :, top:top + size, left:left + size]
        mean = torch.tensor(CLIP_MEAN).view(1, 3, 1, 1)
        std = torch.tensor(CLIP_STD).view(1, 3, 1, 1)
        return (x - mean) / std


def config_from_state(state: dict[str, torch.Tensor]) -> CLIPVisionConfig:
    """The encoder's shape read from a `vision_model.*` state dict (head size 80 as in ViT-H/14
    and ViT-L/14, unless the hidden size says otherwise)."""
    prefix = "vision_model."
    patch = state[prefix + "embeddings.patch_embedding.weight"]
    hidden, patch_size = patch.shape[0], patch.shape[-1]
    tokens = state[prefix + "embeddings.position_embedding.weight"].shape[0]
    layers = 1 + max(int(k[len(prefix + "encoder.layers."):].split(".")[0])
                     for k in state if k.startswith(prefix + "encoder.layers."))
    intermediate = state[prefix + "encoder.layers.0.mlp.fc1.weight"].shape[0]
    head_dim = 80 if hidden % 80 == 0 else 64
    return CLIPVisionConfig(hidden=hidden, layers=layers, heads=hidden // head_dim,
                            intermediate=intermediate,
                            image_size=math.isqrt(tokens - 1) * patch_size, patch=patch_size)
