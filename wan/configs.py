"""Model configurations: the DiT hyper-parameters and the released Wan sizes.

A checkpoint's configuration is inferred from its tensor shapes (see checkpoints/detect.py);
the released sizes below let detection name the model and reject shapes that match none.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

from .latent_format import WAN21_LATENT, WAN22_LATENT, LatentFormat


@dataclass(frozen=True)
class DiTConfig:
    in_dim: int = 16
    out_dim: int = 16
    dim: int = 1536
    ffn_dim: int = 8960
    num_heads: int = 12
    num_layers: int = 30
    freq_dim: int = 256
    text_dim: int = 4096
    text_len: int = 512
    patch_size: tuple[int, int, int] = (1, 2, 2)
    eps: float = 1e-6
    qk_norm: bool = True
    cross_attn_norm: bool = True
    # Wan2.1 image-to-video: a CLIP image projection and separate image keys/values in
    # cross-attention. Wan2.2 I2V has neither (its image enters through the extra in_dim channels).
    image_embedding: bool = False
    # FLF2V: a learned position embedding over the two images' CLIP tokens.
    image_pos_embedding: bool = False
    image_dim: int = 1280
    name: str = "custom"

    def __post_init__(self):
        if self.dim % self.num_heads:
            raise ValueError(f"dim {self.dim} is not divisible by num_heads {self.num_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim {self.head_dim} must be even for the rotary embedding")

    @property
    def head_dim(self) -> int:
        return self.dim // self.num_heads

    @property
    def rope_pairs(self) -> tuple[int, int, int]:
        """Rotation pairs per axis (frame, height, width): 22/21/21 for head_dim 128."""
        c = self.head_dim // 2
        return (c - 2 * (c // 3), c // 3, c // 3)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["patch_size"] = list(self.patch_size)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "DiTConfig":
        known = {f for f in cls.__dataclass_fields__}
        kwargs = {k: v for k, v in d.items() if k in known}
        if "patch_size" in kwargs:
            kwargs["patch_size"] = tuple(kwargs["patch_size"])
        return cls(**kwargs)

    def renamed(self, name: str) -> "DiTConfig":
        return replace(self, name=name)


@dataclass(frozen=True)
class KnownDiT:
    """A released model: its configuration and the VAE it works with."""
    config: DiTConfig
    vae: str  # a key of VAES
    family: str  # "wan2.1" or "wan2.2"
    experts: tuple[str, ...] = field(default=())


def _dit(name, **kw) -> DiTConfig:
    return DiTConfig(name=name, **kw)


_14B = dict(dim=5120, ffn_dim=13824, num_heads=40, num_layers=40)

KNOWN_DITS: dict[str, KnownDiT] = {
    "wan2.1-t2v-1.3b": KnownDiT(_dit("wan2.1-t2v-1.3b", dim=1536, ffn_dim=8960, num_heads=12,
                                     num_layers=30), "vae21", "wan2.1"),
    "wan2.1-t2v-14b": KnownDiT(_dit("wan2.1-t2v-14b", **_14B), "vae21", "wan2.1"),
    "wan2.1-i2v-14b": KnownDiT(_dit("wan2.1-i2v-14b", in_dim=36, image_embedding=True, **_14B),
                               "vae21", "wan2.1"),
    "wan2.1-flf2v-14b": KnownDiT(_dit("wan2.1-flf2v-14b", in_dim=36, image_embedding=True,
                                      image_pos_embedding=True, **_14B), "vae21", "wan2.1"),
    "wan2.2-ti2v-5b": KnownDiT(_dit("wan2.2-ti2v-5b", in_dim=48, out_dim=48, dim=3072,
                                    ffn_dim=14336, num_heads=24, num_layers=30), "vae22", "wan2.2"),
    # The A14B experts share one shape: T2V experts have the Wan2.1 14B shape, I2V experts
    # take 36 input channels without the CLIP branch.
    "wan2.2-i2v-a14b": KnownDiT(_dit("wan2.2-i2v-a14b", in_dim=36, **_14B), "vae21", "wan2.2",
                                ("high_noise", "low_noise")),
}

# Same tensor shapes as wan2.1-t2v-14b: detection cannot tell them apart, so it names both.
SAME_SHAPE_ALIASES = {"wan2.1-t2v-14b": ("wan2.2-t2v-a14b",)}

HEAD_DIM = 128  # every released size; used when a checkpoint carries no head count

# Both Wan VAEs: latent frame i > 0 stands for 4 video frames (frame 0 for one), so videos have
# 4n + 1 frames.
TEMPORAL_STRIDE = 4

# Wan2.2 A14B: the high-noise expert runs while t >= boundary * 1000.
EXPERT_BOUNDARY = {"t2v": 0.875, "i2v": 0.900}


@dataclass(frozen=True)
class VAESpec:
    """A released Wan VAE: what the rest of the package needs to know of it."""
    kind: str  # the key files, models and workflows are matched by
    name: str
    latent_channels: int
    spatial_stride: int  # pixels per latent pixel
    latent_format: LatentFormat  # the normalisation its DiTs work in
    # its DiTs (TI2V-5B) take a timestep per latent frame, so a start image is given as the
    # first latent frame(s), kept clean while the rest is denoised
    keeps_first_frames: bool = False
    temporal_stride: int = TEMPORAL_STRIDE


VAES: dict[str, VAESpec] = {
    "vae21": VAESpec("vae21", "Wan2.1 VAE", latent_channels=16, spatial_stride=8,
                     latent_format=WAN21_LATENT),
    "vae22": VAESpec("vae22", "Wan2.2 VAE", latent_channels=48, spatial_stride=16,
                     latent_format=WAN22_LATENT, keeps_first_frames=True),
}


def vae_kind(config: DiTConfig) -> str:
    """The VAE whose latents a DiT works on: the one whose latent channels it outputs (the
    Wan2.2 VAE for TI2V-5B's 48, the Wan2.1 VAE otherwise)."""
    matching = [spec.kind for spec in VAES.values() if spec.latent_channels == config.out_dim]
    return matching[0] if matching else "vae21"


def vae_spec(config: DiTConfig) -> VAESpec:
    return VAES[vae_kind(config)]


def pixel_stride(config: DiTConfig) -> int:
    """Pixels per latent-grid step times the patch: what a video's width and height divide by."""
    return vae_spec(config).spatial_stride * config.patch_size[1]


def match_known(config: DiTConfig) -> str | None:
    """The released model whose shapes equal `config`, or None."""
    for name, known in KNOWN_DITS.items():
        k = known.config
        if (k.in_dim, k.out_dim, k.dim, k.ffn_dim, k.num_heads, k.num_layers, k.image_embedding,
                k.image_pos_embedding, k.text_dim, k.freq_dim, k.patch_size) == (
                config.in_dim, config.out_dim, config.dim, config.ffn_dim, config.num_heads,
                config.num_layers, config.image_embedding, config.image_pos_embedding,
                config.text_dim, config.freq_dim, config.patch_size):
            return name
    return None


@dataclass(frozen=True)
class T5Config:
    """umT5 encoder hyper-parameters; the defaults are umt5-xxl, the text encoder of every Wan
    model. Everything but max_distance and eps is visible in a checkpoint's shapes."""
    vocab_size: int = 256384
    dim: int = 4096
    dim_attn: int = 4096
    dim_ffn: int = 10240
    num_heads: int = 64
    num_layers: int = 24
    num_buckets: int = 32
    max_distance: int = 128
    eps: float = 1e-6

    def to_dict(self) -> dict:
        return asdict(self)


KNOWN_T5 = {"umt5-xxl": T5Config()}
