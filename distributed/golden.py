"""DiT golden files with the model split over a worker group: the same forwards and scores as
conformance/run_dit.py, each forward computed sequence-parallel by the group's ranks (every rank
reads the weights from the file itself; with fsdp each keeps its chunks of the blocks)."""

from __future__ import annotations

from pathlib import Path

from ..conformance.golden_file import GoldenFileError, Report, read_golden, score
from ..conformance.run_dit import checks
from .contracts import ForwardCase, ForwardRequest, ModelSpec

DIT_KINDS = ("dit_wan21", "dit_wan22_ti2v")
TIMEOUT_S = 600


def check_file_split(path: str | Path, group, mode: str = "auto",
                     fsdp: bool = False) -> tuple[Report, str]:
    """The file's report, and the self-attention the ranks used ("ulysses" or "ring"). fsdp:
    the blocks sharded over the ranks as well (sharded_blocks.py)."""
    golden = read_golden(path)
    if golden.kind not in DIT_KINDS:
        raise GoldenFileError(f"{path}: kind {golden.kind!r} is not a DiT; only "
                              f"{', '.join(DIT_KINDS)} files run split over processes")
    forwards = checks(golden)
    cases = tuple(ForwardCase(c.x, c.t, c.context, y=c.inputs.get("y"),
                              clip_tokens=c.inputs.get("clip_tokens")) for c in forwards)
    request = ForwardRequest(ModelSpec(golden=str(Path(path).resolve()), fsdp=fsdp), cases,
                             mode=mode, keep_model=False)
    result = group.run(".distributed.tasks:forward", request, timeout_s=TIMEOUT_S)
    scores = [score(c.case, c.output, out, c.expected, golden.tolerance("y"))
              for c, out in zip(forwards, result.outputs)]
    used = "ring" if any(m["ring_calls"] for m in result.metrics) else "ulysses"
    return Report(Path(path), golden.kind, scores), used
