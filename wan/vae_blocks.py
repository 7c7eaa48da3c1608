"""Building blocks shared by the Wan2.1 and Wan2.2 video VAEs.

Both VAEs are causal in time and run a video chunk by chunk: the encoder sees frame 0 alone and
then four frames at a time, the decoder one latent frame at a time. Every layer that looks back in
time carries the frames it needs into the next chunk. Those frames live in a `CausalCache` that
encode/decode create for one call and hand down the forward calls; the modules hold nothing but
their parameters, so nothing survives a call and repeated runs cannot grow memory.

Attribute names and the positions inside `residual`, `resample` and `head` are the key names of
the official checkpoints, so their state dicts load strictly.

On CUDA the decoder runs in the channels_last_3d memory format (CausalVideoVAE.decode_frames
decides it once per call and records it on the cache): every pixel's channels are contiguous,
which is the layout cuDNN's convolutions compute in, so no convolution converts its input or
output. Each layer then keeps that layout: the reshaping layers copy in channels-last order,
a causal convolution's input is written straight into one buffer behind its history (no
concatenation), and the norm and SiLU before a convolution run as one pass (channel_norm.py)
into that buffer. Elsewhere (the CPU, the encoder) the layers run as written for NCDHW.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import channel_norm

# The encoder takes frame 0 alone, then chunks of this many frames (one latent frame each).
ENCODE_CHUNK_FRAMES = 4


def encode_chunks(frames: int) -> Iterator[tuple[int, int]]:
    """(start, stop) frame ranges the encoder runs on: frame 0 alone, then 1-4, 5-8, ..."""
    yield 0, 1
    for start in range(1, frames, ENCODE_CHUNK_FRAMES):
        yield start, start + ENCODE_CHUNK_FRAMES


class CausalCache:
    """The frames that the causal layers of one encoder or decoder carry from chunk to chunk.

    One instance serves a single encode or decode call and is dropped with it. Entries are keyed by
    the layer that owns them; a layer takes its entry out before it keeps the next one, so each
    layer holds at most one entry and an old entry is freed as soon as it has been used.
    """

    def __init__(self, channels_last: bool = False) -> None:
        self._frames: dict[nn.Module, torch.Tensor] = {}
        self._chunks_begun = 0
        # the activations are channels_last_3d and the layers keep them so (see the module's doc)
        self.channels_last = channels_last

    def begin_chunk(self) -> None:
        self._chunks_begun += 1

    @property
    def is_first_chunk(self) -> bool:
        return self._chunks_begun == 1

    def take(self, layer: nn.Module) -> torch.Tensor | None:
        """What `layer` kept during the previous chunk, or None if it kept nothing."""
        return self._frames.pop(layer, None)

    def keep(self, layer: nn.Module, frames: torch.Tensor) -> None:
        # A copy, so the chunk the frames were cut from can be freed.
        self._frames[layer] = frames.clone()


class CausalConv3d(nn.Conv3d):
    """3D convolution that looks only backwards in time.

    Space is zero-padded symmetrically ("same" size). In time the kernel sees the frames this layer
    received at the end of the previous chunk, and zeros before the first frame, so a video run
    chunk by chunk gives the same result as one causal pass over the whole video.
    """

    def __init__(self, in_channels: int, out_channels: int, kernel_size) -> None:
        kt, kh, kw = (kernel_size,) * 3 if isinstance(kernel_size, int) else kernel_size
        super().__init__(in_channels, out_channels, (kt, kh, kw), padding=(0, kh // 2, kw // 2))
        self.history_frames = kt - 1

    def forward(self, x: torch.Tensor, cache: CausalCache | None = None) -> torch.Tensor:
        if self.history_frames == 0:
            return super().forward(x)
        if cache.channels_last:
            stream, fresh = self.open_stream(x, cache)
            fresh.copy_(x)
            return self.run_stream(stream, cache)
        history = cache.take(self)
        parts = [x] if history is None else [history, x]
        missing = self.history_frames - (0 if history is None else history.shape[2])
        if missing > 0:
            parts.insert(0, x.new_zeros(x.shape[0], x.shape[1], missing, *x.shape[3:]))
        stream = torch.cat(parts, dim=2)
        cache.keep(self, stream[:, :, -self.history_frames:])
        return super().forward(stream)

    def open_stream(self, x: torch.Tensor, cache: CausalCache) -> tuple[torch.Tensor, torch.Tensor]:
        """A channels-last buffer [B, C, history + T, H, W] for an input shaped like x: this
        layer's history (zeros before the first frame) already in front, and the view of the T
        frames behind it, for the caller to fill with the input before run_stream."""
        k = self.history_frames
        b, c, t, h, w = x.shape
        stream = torch.empty((b, c, k + t, h, w), dtype=x.dtype, device=x.device,
                             memory_format=torch.channels_last_3d)
        history = cache.take(self)
        missing = k - (0 if history is None else history.shape[2])
        if missing > 0:
            stream[:, :, :missing].zero_()
        if history is not None:
            stream[:, :, missing:k].copy_(history)
        return stream, stream[:, :, k:]

    def run_stream(self, stream: torch.Tensor, cache: CausalCache,
                   bias: bool = True) -> torch.Tensor:
        """The convolution of a buffer from open_stream, once filled; its last frames are kept.
        Without `bias` the bias is left for the caller to add (cuDNN's convolutions leave it to a
        pass of its own)."""
        cache.keep(self, stream[:, :, -self.history_frames:])
        return self._conv_forward(stream, self.weight, self.bias if bias else None)


class FrameConv2d(nn.Conv2d):
    """A 2D convolution applied to every frame of a [B, C, T, H, W] video.

    Running the 2D kernel as a 1 x kh x kw 3D kernel avoids folding time into the batch, which
    would copy the whole activation twice.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.conv3d(x, self.weight.unsqueeze(2), self.bias,
                        stride=(1, *self.stride), padding=(0, *self.padding))


class ChannelRMSNorm(nn.Module):
    """Normalises every pixel's channel vector to unit RMS, then applies a per-channel gain.

    `gain_dims` only sets the stored shape of `gamma` ([C,1,1,1] in residual blocks and heads,
    [C,1,1] in attention blocks), which the checkpoints fix; the norm works on any [B, C, ...].
    """

    def __init__(self, channels: int, gain_dims: int = 3) -> None:
        super().__init__()
        self.scale = channels ** 0.5
        self.gamma = nn.Parameter(torch.ones(channels, *([1] * gain_dims)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gain = self.gamma.view(-1, *([1] * (x.dim() - 2)))
        return F.normalize(x, dim=1).mul_(self.scale).mul_(gain)

    def into(self, x: torch.Tensor, out: torch.Tensor, silu: bool,
             bias: torch.Tensor | None = None) -> torch.Tensor:
        """The norm of x (plus a per-channel `bias` first, where given), then SiLU if `silu`,
        written into `out` (x's shape): in one pass by the Triton kernel where it can
        (channels-last rows on CUDA), else as forward and F.silu, copied."""
        if channel_norm.kernel_usable(x, out):
            return channel_norm.launch(x, self.gamma, self.scale, silu, out, bias)
        if bias is not None:
            x = x + bias.view(-1, *([1] * (x.dim() - 2)))
        y = self(x)
        return out.copy_(F.silu(y, inplace=True) if silu else y)


def _norm_silu_conv(norm: ChannelRMSNorm, conv: CausalConv3d, x: torch.Tensor,
                    cache: CausalCache, x_bias: torch.Tensor | None = None,
                    conv_bias: bool = True) -> torch.Tensor:
    """conv(silu(norm(x + x_bias))) on channels-last activations: the norm and SiLU are written
    straight into the convolution's input buffer, behind its history. Without `conv_bias` the
    result lacks the convolution's bias (the next norm adds it as its x_bias). An x_bias is
    added to x in place where the kernel cannot take it (x is the caller's to give up), so the
    fallback holds no copy of x besides the norm's."""
    stream, fresh = conv.open_stream(x, cache)
    if x_bias is not None and not channel_norm.kernel_usable(x, fresh):
        x, x_bias = x.add_(x_bias.view(-1, *([1] * (x.dim() - 2)))), None
    norm.into(x, fresh, silu=True, bias=x_bias)
    return conv.run_stream(stream, cache, bias=conv_bias)


class ResidualBlock(nn.Module):
    """norm -> SiLU -> causal conv -> norm -> SiLU -> dropout -> causal conv, plus a shortcut."""

    def __init__(self, in_channels: int, out_channels: int, dropout: float = 0.0) -> None:
        super().__init__()
        # The positions give the key names residual.{0,2,3,6}.
        self.residual = nn.Sequential(
            ChannelRMSNorm(in_channels), nn.SiLU(inplace=True),
            CausalConv3d(in_channels, out_channels, 3),
            ChannelRMSNorm(out_channels), nn.SiLU(inplace=True), nn.Dropout(dropout),
            CausalConv3d(out_channels, out_channels, 3))
        self.shortcut = (CausalConv3d(in_channels, out_channels, 1)
                         if in_channels != out_channels else nn.Identity())

    def forward(self, x: torch.Tensor, cache: CausalCache) -> torch.Tensor:
        norm1, act1, conv1, norm2, act2, dropout, conv2 = self.residual
        if cache.channels_last and not (dropout.training and dropout.p > 0):
            h = _norm_silu_conv(norm1, conv1, x, cache, conv_bias=False)
            h = _norm_silu_conv(norm2, conv2, h, cache, x_bias=conv1.bias)
            return h.add_(self.shortcut(x))
        # One step per line, so each intermediate is freed as soon as the next one exists.
        h = act1(norm1(x))
        h = conv1(h, cache)
        h = act2(norm2(h))
        h = conv2(dropout(h), cache)
        return h.add_(self.shortcut(x))


class FrameAttention(nn.Module):
    """Single-head self-attention among the pixels of each frame; frames never see each other."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.norm = ChannelRMSNorm(channels, gain_dims=2)
        self.to_qkv = FrameConv2d(channels, channels * 3, 1)
        self.proj = FrameConv2d(channels, channels, 1)

    def forward(self, x: torch.Tensor, cache: CausalCache | None = None) -> torch.Tensor:
        # `cache` is unused (nothing crosses frames); it keeps the layer interface uniform.
        b, c, t, h, w = x.shape
        if cache is not None and cache.channels_last:
            normed = torch.empty_like(x, memory_format=torch.channels_last_3d)
            qkv = self.to_qkv(self.norm.into(x, normed, silu=False))
        else:
            qkv = self.to_qkv(self.norm(x))
        tokens = qkv.permute(0, 2, 3, 4, 1).reshape(b * t, 1, h * w, 3 * c)
        q, k, v = tokens.chunk(3, dim=-1)
        out = F.scaled_dot_product_attention(q, k, v)
        out = out.view(b, t, h, w, c).permute(0, 4, 1, 2, 3)
        return self.proj(out).add_(x)


class PadRightBottom(nn.Module):
    """One zero row below and one zero column right of every frame, for the stride-2 conv."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.pad(x, (0, 1, 0, 1))


class NearestUpsample2x(nn.Module):
    """Doubles height and width of every frame by repeating each pixel into a 2x2 block.

    Equal to nearest-exact interpolation at scale 2, written as one broadcast copy, which on a
    GPU is several times faster than the 3D interpolation kernel.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, t, h, w = x.shape
        if _is_channels_last(x):  # the copy in channels-last order
            rows = x.permute(0, 2, 3, 4, 1)
            blocks = rows[:, :, :, None, :, None].expand(b, t, h, 2, w, 2, c)
            return blocks.contiguous().view(b, t, 2 * h, 2 * w, c).permute(0, 4, 1, 2, 3)
        blocks = x[:, :, :, :, None, :, None].expand(b, c, t, h, 2, w, 2)
        return blocks.reshape(b, c, t, 2 * h, 2 * w)


def _is_channels_last(x: torch.Tensor) -> bool:
    """x [B, C, T, H, W] holds each pixel's channels contiguously, and is not plain NCDHW
    (only for layers that move values and compute nothing, where both layouts give the same
    values)."""
    return x.shape[1] > 1 and not x.is_contiguous() and \
        x.is_contiguous(memory_format=torch.channels_last_3d)


class Downsample(nn.Module):
    """Halves height and width; with `temporal`, also halves the frame rate causally.

    The time convolution (kernel 3, stride 2) sees the last frame of the previous chunk. The first
    chunk is a single frame and passes through untouched, so frame 0 alone makes latent frame 0.
    """

    def __init__(self, channels: int, temporal: bool) -> None:
        super().__init__()
        self.resample = nn.Sequential(PadRightBottom(), FrameConv2d(channels, channels, 3, stride=2))
        self.time_conv = (nn.Conv3d(channels, channels, (3, 1, 1), stride=(2, 1, 1))
                          if temporal else None)

    def forward(self, x: torch.Tensor, cache: CausalCache) -> torch.Tensor:
        x = self.resample(x)
        if self.time_conv is None:
            return x
        previous = cache.take(self)
        cache.keep(self, x[:, :, -1:])
        if previous is None:
            return x
        return self.time_conv(torch.cat([previous, x], dim=2))


class Upsample(nn.Module):
    """Doubles height and width; with `temporal`, also doubles the frame count causally.

    The time convolution makes two output frames per input frame (its two channel halves). It does
    not run on the first chunk, so latent frame 0 decodes to a single frame, and its stream starts
    on the second chunk with a zero history: the first frame's features never enter it.
    """

    def __init__(self, channels: int, out_channels: int, temporal: bool) -> None:
        super().__init__()
        self.resample = nn.Sequential(NearestUpsample2x(),
                                      FrameConv2d(channels, out_channels, 3, padding=1))
        self.time_conv = CausalConv3d(channels, channels * 2, (3, 1, 1)) if temporal else None

    def forward(self, x: torch.Tensor, cache: CausalCache) -> torch.Tensor:
        if self.time_conv is not None and not cache.is_first_chunk:
            x = _interleave_channel_halves(self.time_conv(x, cache))
        return self.resample(x)


def _interleave_channel_halves(x: torch.Tensor) -> torch.Tensor:
    """[B, 2C, T, H, W] -> [B, C, 2T, H, W]: frame 2t from the first half, 2t+1 from the second."""
    b, c2, t, h, w = x.shape
    if _is_channels_last(x):  # the copy in channels-last order
        rows = x.permute(0, 2, 3, 4, 1).reshape(b, t, h, w, 2, c2 // 2)
        return rows.permute(0, 1, 4, 2, 3, 5).contiguous().view(b, 2 * t, h, w, c2 // 2) \
            .permute(0, 4, 1, 2, 3)
    return x.view(b, 2, c2 // 2, t, h, w).permute(0, 2, 3, 1, 4, 5).reshape(b, c2 // 2, 2 * t, h, w)


class MiddleStack(nn.ModuleList):
    """Residual block, frame attention, residual block at the lowest resolution."""

    def __init__(self, channels: int, dropout: float) -> None:
        super().__init__([ResidualBlock(channels, channels, dropout), FrameAttention(channels),
                          ResidualBlock(channels, channels, dropout)])

    def forward(self, x: torch.Tensor, cache: CausalCache) -> torch.Tensor:
        for layer in self:
            x = layer(x, cache)
        return x


class OutputHead(nn.Sequential):
    """norm -> SiLU -> causal conv to the output channels (key names head.0, head.2)."""

    def __init__(self, in_channels: int, out_channels: int) -> None:
        super().__init__(ChannelRMSNorm(in_channels), nn.SiLU(inplace=True),
                         CausalConv3d(in_channels, out_channels, 3))

    def forward(self, x: torch.Tensor, cache: CausalCache) -> torch.Tensor:
        norm, act, conv = self
        if cache.channels_last:
            return _norm_silu_conv(norm, conv, x, cache)
        return conv(act(norm(x)), cache)


class CausalVideoVAE(nn.Module):
    """encode / decode around a causal encoder and decoder: chunking, caches, dtype and device.

    Subclasses build `encoder(chunk, cache)`, which maps a chunk of RGB frames to the 2*z_dim
    moments, and `decoder(latent_frame, cache)`, which maps one latent frame to RGB frames.
    Outputs come in the parameter dtype on the parameter device.

    The decoder runs in `decode_memory_format` (None: channels_last_3d on CUDA, NCDHW
    elsewhere); a decode first brings the decoder's convolution weights into that format, in
    place (a placement that swaps the weights in and out brings its own back).
    """

    decode_memory_format: torch.memory_format | None = None

    def __init__(self, encoder: nn.Module, decoder: nn.Module, z_dim: int, spatial_stride: int,
                 temporal_stride: int) -> None:
        super().__init__()
        self.z_dim = z_dim
        self.spatial_stride = spatial_stride
        self.temporal_stride = temporal_stride
        self.encoder = encoder
        self.conv1 = nn.Conv3d(z_dim * 2, z_dim * 2, 1)
        self.conv2 = nn.Conv3d(z_dim, z_dim, 1)
        self.decoder = decoder

    def _like_parameters(self, x: torch.Tensor) -> torch.Tensor:
        p = next(self.parameters())
        return x.to(device=p.device, dtype=p.dtype)

    @torch.no_grad()
    def encode(self, video: torch.Tensor) -> torch.Tensor:
        """[B, 3, 1+4k, H, W] video in [-1, 1] -> raw (not normalised) mu [B, z, 1+k, H/s, W/s]."""
        if video.dim() != 5 or video.shape[1] != 3:
            raise ValueError(f"expected a video [B, 3, T, H, W], got {list(video.shape)}")
        frames = video.shape[2]
        if (frames - 1) % ENCODE_CHUNK_FRAMES:
            raise ValueError(f"the frame count must be 1 + {ENCODE_CHUNK_FRAMES}k, got {frames}")
        cache = CausalCache()
        moments = []
        for start, stop in encode_chunks(frames):
            cache.begin_chunk()
            moments.append(self.encoder(self._like_parameters(video[:, :, start:stop]), cache))
        mu = self.conv1(torch.cat(moments, dim=2))[:, : self.z_dim]
        return mu.clone()  # own storage, without the discarded log-variance half

    def decode_frames(self, mu: torch.Tensor) -> Iterator[torch.Tensor]:
        """Yields the video decoded from each latent frame as it is produced: 1 frame, then 4, 4, ...

        `mu` is the raw (de-normalised) latent [B, z, T, h, w]. Values are not clamped.
        """
        if mu.dim() != 5 or mu.shape[1] != self.z_dim:
            raise ValueError(f"expected a latent [B, {self.z_dim}, T, h, w], got {list(mu.shape)}")
        return self._decode_frames(mu)

    def decode_layout(self, device: torch.device) -> torch.memory_format:
        """The memory format the decoder runs in on `device`."""
        if self.decode_memory_format is not None:
            return self.decode_memory_format
        return torch.channels_last_3d if device.type == "cuda" else torch.contiguous_format

    @torch.no_grad()
    def _decode_frames(self, mu: torch.Tensor) -> Iterator[torch.Tensor]:
        x = self.conv2(self._like_parameters(mu))
        # The latent's frames need no conversion: the decoder's first (causal) convolution
        # copies each into its channels-last input buffer.
        channels_last = self.decode_layout(x.device) == torch.channels_last_3d
        set_weight_layout(self.decoder, channels_last)
        cache = CausalCache(channels_last=channels_last)
        for t in range(x.shape[2]):
            cache.begin_chunk()
            yield self.decoder(x[:, :, t:t + 1], cache)

    def decode(self, mu: torch.Tensor) -> torch.Tensor:
        """Raw latent [B, z, T, h, w] -> video [B, 3, 1 + 4(T-1), h*s, w*s], not clamped.

        (4 is the temporal stride of the released models.) The chunks are gathered before they
        are joined; callers that want a bounded footprint consume decode_frames instead.
        """
        return torch.cat(list(self.decode_frames(mu)), dim=2)


def set_weight_layout(module: nn.Module, channels_last: bool) -> None:
    """Bring the weights of the convolutions in `module` into channels-last order (channels_last
    and channels_last_3d) or back to contiguous, in place where they are not so already."""
    for conv in module.modules():
        if not isinstance(conv, (nn.Conv2d, nn.Conv3d)):
            continue
        weight = conv.weight
        if not channels_last:
            layout = torch.contiguous_format
        else:
            layout = torch.channels_last_3d if weight.dim() == 5 else torch.channels_last
        if not weight.is_contiguous(memory_format=layout):
            # the same kind of tensor as the weight was made: a normal weight stays usable
            # where autograd records, and an inference one (loaded by a node in inference mode)
            # must not receive normal data, whose views PyTorch cannot version
            with torch.inference_mode(weight.is_inference()), torch.no_grad():
                weight.data = weight.data.contiguous(memory_format=layout)
