"""One run's wall time split into the phases a user waits through.

Each node's time (from the runner's start and finish events) goes to the phase of its class:
loading (the model, text-encoder, VAE, CLIP-vision and LoRA loaders), text encoding, sampling,
decoding, writing the video, and the rest (latents, start images, probes); the node that
writes while it decodes counts to decoding up to its DECODE_DONE event and to writing after.
A sampler's time is split further by its step events (profiling/events.py): up to the end of its first step
(placing the model, compiling, kernel builds and the step itself), the steady steps after it,
and what follows its last step. A node the runner took from its cache takes no time.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..nodes.common import DECODE_DONE
from ..profiling.report_data import step_number

PHASE_OF = {
    "WanEnhancedModelLoader": "load", "WanEnhancedTextEncoderLoader": "load",
    "WanEnhancedVAELoader": "load", "WanEnhancedCLIPVisionLoader": "load",
    "WanEnhancedLoRALoader": "load", "WanEnhancedTextEncode": "text_encode",
    "WanEnhancedSampler": "sample", "WanEnhancedTiledDecode": "decode",
    "WanEnhancedSaveVideo": "video_write", "WanEnhancedDecodeSaveVideo": "decode_write",
}
PHASES = ("load", "text_encode", "first_step", "steady_steps", "sample_rest", "decode",
          "video_write", "other", "total")


@dataclass(frozen=True)
class NodeTime:
    """When a node ran (time.time(), the memory event log's clock) and for how long."""
    node_id: str
    class_type: str
    start: float
    seconds: float
    cached: bool = False


def run_phases(nodes: list[NodeTime], events: list[dict], total: float) -> dict:
    """Seconds per phase (PHASES), the steady steps' count, and `total` (the run's wall time,
    which also holds what ran between nodes)."""
    out = {phase: 0.0 for phase in PHASES}
    steady_count = 0
    for node in nodes:
        if node.cached:
            continue
        phase = PHASE_OF.get(node.class_type, "other")
        if phase == "decode_write":
            decoded = [e["time"] for e in events
                       if e.get("node") == node.node_id and e.get("label") == DECODE_DONE]
            split = min(decoded[-1] - node.start, node.seconds) if decoded else node.seconds
            out["decode"] += split
            out["video_write"] += node.seconds - split
            continue
        if phase != "sample":
            out[phase] += node.seconds
            continue
        steps = sorted(e["time"] for e in events
                       if e.get("node") == node.node_id and step_number(e) is not None)
        end = node.start + node.seconds
        if not steps:
            out["sample_rest"] += node.seconds
            continue
        out["first_step"] += steps[0] - node.start
        out["steady_steps"] += steps[-1] - steps[0]
        out["sample_rest"] += end - steps[-1]
        steady_count += len(steps) - 1
    out["total"] = total
    rounded = {phase: round(seconds, 3) for phase, seconds in out.items()}
    rounded["steady_step_count"] = steady_count
    return rounded
