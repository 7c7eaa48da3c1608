"""Symmetric per-row quantization: one float32 scale per row, value = code * scale.

Rows are a weight's output channels (scales fixed at load) or an activation's tokens (scales
computed at every call, "dynamic"). A row's scale maps its largest magnitude onto the format's
largest code, so each row uses the whole code range whatever the spread between rows.
"""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass
from typing import NamedTuple

import torch

# Smallest scale kept: an all-zero row gets this instead of 0, so 0 / scale stays 0 (not NaN).
# A normal float32 number, which GPUs do not flush to zero.
_SMALLEST_SCALE = torch.finfo(torch.float32).tiny

# Weights are quantized this many elements at a time, so the float32 working copy of even the
# largest matrix (14B FFN: 70M elements) stays small next to the model while it loads.
_LOAD_CHUNK_ELEMENTS = 1 << 22

# Python's anonymous mappings are shared by default, which Linux counts as shared memory
# (RssShmem). The working copy is the process's own, so it is mapped private (RssAnon).
# Windows has no such flags.
_PRIVATE = ({"flags": mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS} if hasattr(mmap, "MAP_PRIVATE")
            else {})


@dataclass(frozen=True)
class RowFormat:
    dtype: torch.dtype
    max_code: float
    rounds: bool  # integer codes are rounded; the fp8 cast rounds by itself (to nearest even)

    def scales(self, rows: torch.Tensor) -> torch.Tensor:
        """float32 [..., 1]: each row's largest magnitude over the largest code."""
        amax = rows.abs().amax(dim=-1, keepdim=True).float()
        return (amax / self.max_code).clamp_min(_SMALLEST_SCALE)

    def encode(self, rows: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        scaled = rows.float() / scales
        if self.rounds:
            scaled = scaled.round()
        return scaled.clamp(-self.max_code, self.max_code).to(self.dtype)


FP8 = RowFormat(torch.float8_e4m3fn, torch.finfo(torch.float8_e4m3fn).max, rounds=False)
INT8 = RowFormat(torch.int8, 127.0, rounds=True)


class RowCodes(NamedTuple):
    """An activation [..., K] handed to fp8 matmuls as their input: fp8 e4m3fn codes [M, K] and
    float32 scales [M, 1], one per token (quantize_rows with FP8); `shape` and
    `dtype` are the activation's, which is never stored. Made by a norm that does its own
    quantization (wan/glue.py norm_codes); taken by layers with `takes_row_codes`
    (quant/linear.py Fp8Linear). A named tuple: torch.compile traces it without a graph break."""
    codes: torch.Tensor
    scales: torch.Tensor
    shape: torch.Size
    dtype: torch.dtype


# Eager runs quantize this many elements at a time, through one float32 working copy: the
# statement's temporaries (the magnitudes, the float32 quotients and their rounding, about 10
# bytes an element) had been 1.3 GB a call at int8 W8A8's second FFN layer at 5B 720p.
_ROWS_CHUNK_ELEMENTS = 1 << 24


def quantize_rows(rows: torch.Tensor, fmt: RowFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes shaped like `rows` and float32 scales [..., 1] (activations: one scale per token).
    Each row on its own, so eager runs take a few rows at a time (the same bits)."""
    width = rows.shape[-1] if rows.dim() else 1
    if (torch.compiler.is_compiling() or rows.numel() <= _ROWS_CHUNK_ELEMENTS
            or width > _ROWS_CHUNK_ELEMENTS):
        scales = fmt.scales(rows)
        return fmt.encode(rows, scales), scales
    codes, scales = _quantize_in_chunks(rows.reshape(-1, width), fmt,
                                        _ROWS_CHUNK_ELEMENTS // width)
    return codes.view(rows.shape), scales.view(*rows.shape[:-1], 1)


def quantize_weight(weight: torch.Tensor, fmt: RowFormat,
                    stored_scales: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """A [out, in] matrix as codes [out, in] and float32 scales [out], a few rows at a time
    (on the device the weight is on), with the same bits as the whole matrix at once.
    stored_scales: float32 [out] that the stored values are multiplied by first (a file's
    quantized weights in another format)."""
    step = max(1, _LOAD_CHUNK_ELEMENTS // max(1, weight[0].numel()))
    return _quantize_in_chunks(weight, fmt, step, stored_scales)


def _quantize_in_chunks(rows: torch.Tensor, fmt: RowFormat, step: int,
                        stored_scales: torch.Tensor | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes shaped like `rows` and float32 scales [rows], `step` rows at a time through one
    float32 working copy (_quantize_chunk: the same bits as all rows at once)."""
    count = rows.shape[0]
    codes = torch.empty(rows.shape, dtype=fmt.dtype, device=rows.device)
    scales = torch.empty(count, dtype=torch.float32, device=rows.device)
    scratch = _scratch(rows, min(step, count))
    for start in range(0, count, step):
        stop = min(start + step, count)
        chunk = scratch[:stop - start]
        chunk.copy_(rows[start:stop])
        if stored_scales is not None:
            chunk.mul_(stored_scales[start:stop, None])
        _quantize_chunk(chunk, fmt, codes[start:stop], scales[start:stop])
    return codes, scales


def _scratch(source: torch.Tensor, rows: int) -> torch.Tensor:
    """The float32 working copy of `rows` rows of `source` (a matrix, an activation), reused
    for every chunk: one allocation per call instead of several per chunk. On the CPU it is an
    anonymous memory mapping of its own, unmapped when the tensor is freed."""
    shape = (rows, *source.shape[1:])
    count = math.prod(shape)
    if source.device.type != "cpu" or count == 0:
        return torch.empty(shape, dtype=torch.float32, device=source.device)
    # From the C heap, the freed 9-16 MiB copy of each matrix leaves a hole between the codes
    # allocated around it, which later allocations fill only in part: glibc kept 0.4-0.7x the
    # model as free heap after a load. A mapping goes back to the kernel as soon as it is freed.
    mapping = mmap.mmap(-1, count * 4, **_PRIVATE)
    return torch.frombuffer(mapping, dtype=torch.float32, count=count).view(shape)


def _quantize_chunk(rows: torch.Tensor, fmt: RowFormat, codes: torch.Tensor,
                    scales: torch.Tensor) -> None:
    """Fill `codes` and `scales` with rows' codes and scales, overwriting the float32 `rows`
    in place (the same operations as RowFormat.scales and RowFormat.encode, so the same bits)."""
    row_scales = _row_scales(rows, fmt)
    rows.div_(row_scales)
    if fmt.rounds:
        rows.round_()
    rows.clamp_(-fmt.max_code, fmt.max_code)
    codes.copy_(rows)  # the cast of .to(fmt.dtype), written straight into the result
    scales.copy_(row_scales[:, 0])


def _row_scales(rows: torch.Tensor, fmt: RowFormat) -> torch.Tensor:
    """RowFormat.scales without the full-size abs() copy: a row's largest magnitude is the
    larger of -min and max (exact, so the same value)."""
    low, high = torch.aminmax(rows, dim=-1, keepdim=True)
    amax = torch.maximum(low.neg_(), high)
    return (amax / fmt.max_code).clamp_min(_SMALLEST_SCALE)


def dequantize_weight(codes: torch.Tensor, scales: torch.Tensor,
                      dtype: torch.dtype) -> torch.Tensor:
    """codes * scales per row, computed in float32 and rounded once to `dtype`."""
    return (codes.float() * scales[:, None]).to(dtype)
