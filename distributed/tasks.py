"""Tasks the worker group runs (worker.resolve_task: ".distributed.tasks:NAME").

Every rank runs the task with the same request; rank 0's return value goes to the driver.
"""

from __future__ import annotations

import time

import torch

from ..profiling.kernels import profiled
from .comm_stats import CommStats
from .contracts import ForwardRequest, ForwardResult
from .metrics import RankMeter, gather_metrics
from .models import rank_models
from .sequence_split import SequenceSplit


PROFILED_KERNELS = 30  # the longest kernels each rank reports from a profiled forward


def forward(state, request: ForwardRequest) -> ForwardResult:
    """DiT forwards with the token sequence split over the group (golden checks, benchmarks)."""
    meter = RankMeter(state.rank, state.device)
    (rank_model,) = rank_models(state, [request.model])
    meter.held([rank_model])
    split = SequenceSplit(None, request.mode, meter.stats) if state.world > 1 else None
    outputs, seconds = [], []
    device = state.device

    def run(case, split):
        return rank_model.model(case.x.to(device), case.t.to(device), case.context.to(device),
                                y=_on(case.y, device), clip_tokens=_on(case.clip_tokens, device),
                                attention=request.model.attention,
                                compiled=request.model.compile, sequence=split,
                                blocks=rank_model.blocks())

    kernels = None
    with torch.no_grad():
        for case in request.cases:
            out = None
            for _ in range(request.repeats):
                del out
                _synchronize(device)
                began = time.perf_counter()
                with meter.stats.forward():
                    out = run(case, split)
                _synchronize(device)
                seconds.append(time.perf_counter() - began)
            outputs.append(out.cpu())
            del out
        if request.profile and request.cases:
            # its collectives go to a counter of their own, out of the metrics
            extra = SequenceSplit(None, request.mode, CommStats(device)) if split else None
            _, totals = profiled(lambda: run(request.cases[-1], extra), device.type)
            kernels = {"kernels": [k.to_dict() for k in totals[:PROFILED_KERNELS]],
                       "kernels_summed_ms": sum(k.ms for k in totals)}
    metrics = meter.finish()
    metrics.update(kernels or {})
    metrics = gather_metrics(metrics, state.control)
    if not request.keep_model:
        for kept in state.cache.pop("models", {}).values():
            kept.close()
    return ForwardResult(outputs, metrics, seconds)


def _on(tensor, device):
    return None if tensor is None else tensor.to(device)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
