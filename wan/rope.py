"""3D rotary position embedding of the Wan DiT.

Each head's channels form head_dim/2 rotation pairs of adjacent channels (2i, 2i+1), split into
frame / height / width groups. Each group rotates by its integer token coordinate times its own
frequency ladder theta^(-j / pairs). Angles are computed in float64 (the reference does the whole
rotation in float64; float64 angles with a float32 rotation stay within ~1e-7 of it).
"""

from __future__ import annotations

import torch


def axis_frequencies(pairs: int, theta: float = 10000.0,
                     device: torch.device | str = "cpu") -> torch.Tensor:
    """theta^(-2j / (2*pairs)) for j < pairs, float64."""
    exponent = torch.arange(0, 2 * pairs, 2, dtype=torch.float64, device=device) / (2 * pairs)
    return 1.0 / torch.pow(theta, exponent)


def rope_angles(grid: tuple[int, int, int], pairs: tuple[int, int, int],
                theta: float = 10000.0, device: torch.device | str = "cpu") -> torch.Tensor:
    """Angles [F*H*W, sum(pairs)] in float64, tokens in (frame, row, column) order."""
    axes = []
    for size, n_pairs, shape in zip(grid, pairs, ((-1, 1, 1), (1, -1, 1), (1, 1, -1))):
        angle = torch.outer(torch.arange(size, dtype=torch.float64, device=device),
                            axis_frequencies(n_pairs, theta, device))
        axes.append(angle.view(*shape, n_pairs).expand(*grid, n_pairs))
    return torch.cat(axes, dim=-1).reshape(-1, sum(pairs))


class RotaryTable:
    """cos/sin of the angles for one token grid, ready to rotate [B, L, heads, head_dim] tensors."""

    def __init__(self, grid: tuple[int, int, int], pairs: tuple[int, int, int],
                 device: torch.device | str = "cpu", theta: float = 10000.0):
        # made on the device: on the CPU, the float64 cos/sin of a 720p video's tables took tens
        # of milliseconds per forward while the GPU waited
        angles = rope_angles(grid, pairs, theta, device)
        # [L, 1, pairs]: broadcast over heads
        self.cos = torch.cos(angles).to(torch.float32)[:, None, :]
        self.sin = torch.sin(angles).to(torch.float32)[:, None, :]

    def rotate(self, x: torch.Tensor, start: int = 0) -> torch.Tensor:
        """Rotate the channel pairs of x [B, L, heads, head_dim], the tokens start..start+L of the
        grid; float32 arithmetic, x's dtype out."""
        b, length, heads, head_dim = x.shape
        cos = self.cos[start:start + length, :, :, None, None]
        sin = self.sin[start:start + length, :, :, None, None]
        # each pair times its rotation matrix, written as (column of even) * even + (column of
        # odd) * odd: the same products and sums as stacking the two rotated channels, but
        # torch.compile fuses it into the norm before it (a stack of computed channels made a
        # separate pass over q and k)
        pairs = x.float().view(b, length, heads, head_dim // 2, 1, 2)
        out = (torch.cat((cos, sin), -2) * pairs[..., 0:1]
               + torch.cat((-sin, cos), -2) * pairs[..., 1:])
        return out.view(b, length, heads, head_dim).to(x.dtype)
