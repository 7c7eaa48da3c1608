"""Reading reference files of the `wan-golden/1` schema and scoring outputs against them.

A golden file is a safetensors file whose `__metadata__["golden"]` JSON names the component
(`kind`), its exact configuration, the cases (which tensors are inputs and outputs) and the
tolerance per output. Weights are stored as `weights.<key>`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

SCHEMA = "wan-golden/1"


class GoldenFileError(ValueError):
    """A file that is not a readable golden file of the expected schema."""


@dataclass
class GoldenCase:
    name: str
    inputs: dict[str, torch.Tensor]
    expected: dict[str, torch.Tensor]
    meta: dict


@dataclass
class GoldenFile:
    path: Path
    kind: str
    config: dict
    meta: dict
    tensors: dict[str, torch.Tensor]

    @property
    def weights(self) -> dict[str, torch.Tensor]:
        prefix = "weights."
        return {k[len(prefix):]: v for k, v in self.tensors.items() if k.startswith(prefix)}

    def tensor(self, key: str) -> torch.Tensor:
        if key not in self.tensors:
            raise GoldenFileError(f"{self.path}: tensor {key!r} named in the metadata is missing")
        return self.tensors[key]

    def cases(self) -> list[GoldenCase]:
        out = []
        for case in self.meta["cases"]:
            out.append(GoldenCase(
                name=case.get("name", case.get("prefix", "?")),
                inputs={n: self.tensor(k) for n, k in case.get("inputs", {}).items()},
                expected={n: self.tensor(k) for n, k in case.get("outputs", {}).items()},
                meta=case,
            ))
        return out

    def tolerance(self, output: str):
        """The tolerance of one output: a float (relative) or the string "exact"."""
        tol = self.meta.get("tolerance", {})
        if output in tol:
            return tol[output]
        raise GoldenFileError(f"{self.path}: no tolerance given for output {output!r}")


def read_golden(path: str | Path) -> GoldenFile:
    path = Path(path)
    if not path.is_file():
        raise GoldenFileError(f"{path}: no such file")
    try:
        with safe_open(str(path), "pt") as f:
            metadata = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as exc:  # safetensors raises several types for damaged files
        raise GoldenFileError(f"{path}: not a readable safetensors file ({exc})") from exc
    if "golden" not in metadata:
        raise GoldenFileError(f"{path}: no 'golden' entry in the safetensors metadata")
    try:
        meta = json.loads(metadata["golden"])
    except json.JSONDecodeError as exc:
        raise GoldenFileError(f"{path}: the 'golden' metadata is not valid JSON ({exc})") from exc
    if meta.get("format") != SCHEMA:
        raise GoldenFileError(f"{path}: format {meta.get('format')!r}, expected {SCHEMA!r}")
    for key in ("kind", "config", "cases"):
        if key not in meta:
            raise GoldenFileError(f"{path}: the golden metadata has no {key!r}")
    return GoldenFile(path=path, kind=meta["kind"], config=meta["config"], meta=meta,
                      tensors=tensors)


@dataclass
class OutputScore:
    case: str
    output: str
    max_abs: float
    max_rel: float
    tolerance: float | str
    passed: bool
    note: str = ""

    def line(self) -> str:
        verdict = "ok  " if self.passed else "FAIL"
        tol = self.tolerance if isinstance(self.tolerance, str) else f"{self.tolerance:.0e}"
        text = (f"{verdict} {self.case:<8} {self.output:<16} max_abs {self.max_abs:.3e}  "
                f"max_rel {self.max_rel:.3e}  (tolerance {tol})")
        return text + (f"  {self.note}" if self.note else "")


@dataclass
class Report:
    path: Path
    kind: str
    scores: list[OutputScore] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return bool(self.scores) and all(s.passed for s in self.scores)


def score(case: str, output: str, actual: torch.Tensor, expected: torch.Tensor,
          tolerance, mask: torch.Tensor | None = None) -> OutputScore:
    """rel = max|actual - expected| / max|expected|, optionally over the positions where mask==1.

    `tolerance` "exact" demands equality (integer timesteps); a float bounds `rel`.
    Shape mismatches and non-finite values fail.
    """
    if tuple(actual.shape) != tuple(expected.shape):
        return OutputScore(case, output, math.inf, math.inf, tolerance, False,
                           f"shape {list(actual.shape)} != expected {list(expected.shape)}")
    a = actual.detach().to("cpu", torch.float64)
    e = expected.detach().to("cpu", torch.float64)
    if mask is not None:
        keep = mask.to(torch.bool)
        while keep.dim() < a.dim():
            keep = keep.unsqueeze(-1)
        keep = keep.expand_as(a)
        a, e = a[keep], e[keep]
    diff = (a - e).abs()
    max_abs = float(diff.max()) if diff.numel() else 0.0
    ref = float(e.abs().max()) if e.numel() else 0.0
    max_rel = max_abs / ref if ref > 0 else (0.0 if max_abs == 0 else math.inf)
    if not torch.isfinite(a).all():
        return OutputScore(case, output, math.inf, math.inf, tolerance, False, "non-finite values")
    if tolerance == "exact":
        passed = max_abs == 0.0
    else:
        passed = max_rel <= float(tolerance)
    return OutputScore(case, output, max_abs, max_rel, tolerance, passed)
