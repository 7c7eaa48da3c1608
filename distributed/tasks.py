"""Tasks the worker group runs (worker.resolve_task: ".distributed.tasks:NAME").

Every rank runs the task with the same request; rank 0's return value goes to the driver.
"""

from __future__ import annotations

import time

import torch

from .contracts import ForwardRequest, ForwardResult
from .metrics import RankMeter, gather_metrics
from .fsdp import sharded_bytes
from .models import rank_models
from .sequence_split import SequenceSplit


def forward(state, request: ForwardRequest) -> ForwardResult:
    """DiT forwards with the token sequence split over the group (golden checks, benchmarks)."""
    meter = RankMeter(state.rank, state.device)
    (model,) = rank_models(state, [request.model])
    meter.weight_bytes = sharded_bytes(model)
    split = SequenceSplit(None, request.mode, meter.stats) if state.world > 1 else None
    outputs, seconds = [], []
    device = state.device
    with torch.no_grad():
        for case in request.cases:
            out = None
            for _ in range(request.repeats):
                del out
                _synchronize(device)
                began = time.perf_counter()
                with meter.stats.forward():
                    out = model(case.x.to(device), case.t.to(device), case.context.to(device),
                                y=_on(case.y, device), clip_tokens=_on(case.clip_tokens, device),
                                attention=request.model.attention,
                                compiled=request.model.compile, sequence=split)
                _synchronize(device)
                seconds.append(time.perf_counter() - began)
            outputs.append(out.cpu())
            del out
    metrics = gather_metrics(meter.finish(), state.control)
    if not request.keep_model:
        state.cache.pop("models", None)
    return ForwardResult(outputs, metrics, seconds)


def _on(tensor, device):
    return None if tensor is None else tensor.to(device)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
