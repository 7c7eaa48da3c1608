"""The sampler's task on the worker group: every rank runs the same denoise loop (same
solver, same steps, the same sample after every step), each computing its share of every model
forward: its rows of the token sequence and, with CFG parallel, its half's conditioning.

Every rank checks the driver's stop flag before each step, agreed over gloo, so all of them stop
at the same step. Both A14B experts stay on the ranks (whole, or sharded with fsdp): the switch
at the boundary only changes which one runs.
"""

from __future__ import annotations

import torch

from ..sampling.experts import ExpertPair, SingleModel
from ..sampling.loop import denoise
from ..sampling.solvers import make_solver
from .cfg_parallel import CfgPair, ParallelModel, topology
from .contracts import ModelSpec, SampleRequest, SampleResult
from .metrics import RankMeter, gather_metrics
from .models import rank_models


def sample(state, request: SampleRequest) -> SampleResult:
    meter = RankMeter(state.rank, state.device)
    models = rank_models(state, list(request.models))
    meter.held(models)
    topo = topology(state)
    device = state.device
    y = _on(request.y, device)
    clip_tokens = _on(request.clip_tokens, device)

    def parallel(rank_model, spec: ModelSpec) -> ParallelModel:
        def forward(x, t, context, split):
            with meter.stats.forward():
                return rank_model.model(x, t, context, y=y, clip_tokens=clip_tokens,
                                        attention=spec.attention, compiled=spec.compile,
                                        sequence=split, blocks=rank_model.blocks())
        return ParallelModel(forward, topo, request.mode, meter.stats)

    runners = [parallel(m, s) for m, s in zip(models, request.models)]
    if len(runners) == 1:
        selector = SingleModel(runners[0], request.cfg)
    else:
        low_cfg = request.cfg if request.cfg_low_noise is None else request.cfg_low_noise
        selector = ExpertPair(runners[0], runners[1], request.boundary, (low_cfg, request.cfg))
    cond = request.cond.to(device, torch.float32)
    uncond = None if request.uncond is None else request.uncond.to(device, torch.float32)
    batched = CfgPair(cond, uncond) if (uncond is not None and request.cfg_parallel
                                        and topo.halves) else None
    total = request.schedule.steps

    def step_done(index, _total, _x):
        state.progress({"step": index + 1, "total": total})

    with torch.no_grad():
        x = denoise(selector, request.start.to(device), make_solver(request.scheduler,
                                                                     request.schedule),
                    cond, uncond=uncond, batched_cond=batched,
                    first_frame=_on(request.first_frame, device), callback=step_done,
                    interrupt=state.check_stop)
    metrics = gather_metrics(meter.finish(), state.control)
    return SampleResult(x.cpu(), metrics, selector.plan(request.schedule))


def _on(tensor, device):
    return None if tensor is None else tensor.to(device, torch.float32)
