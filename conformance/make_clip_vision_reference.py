"""Writes tests/data/clip_vision_reference.safetensors: a tiny CLIP vision tower computed by
transformers' CLIPVisionModel, the reference for wan/clip_vision.py (in the layout of ComfyUI's
clip_vision_h).

    python -m wan_enhanced.conformance.make_clip_vision_reference OUT.safetensors

Needs `transformers` (not a dependency of the package; only this generator uses it). The file
holds the random weights under their checkpoint names, a seeded input, the penultimate hidden
states (`hidden_states[-2]`, what Wan2.1 I2V attends to) and, in its metadata, the config and the
transformers version.
"""

from __future__ import annotations

import json
import sys

import torch
from safetensors.torch import save_file

CONFIG = dict(hidden_size=160, intermediate_size=320, num_hidden_layers=3, num_attention_heads=2,
              image_size=56, patch_size=14, hidden_act="gelu", layer_norm_eps=1e-5)


def main(argv: list[str]) -> int:
    import transformers
    from transformers import CLIPVisionConfig, CLIPVisionModel

    torch.manual_seed(2024)
    model = CLIPVisionModel(CLIPVisionConfig(**CONFIG)).eval()
    with torch.no_grad():  # not transformers' near-identity init: every weight matters
        for tensor in model.state_dict().values():
            tensor.normal_(0, 0.2) if tensor.dim() > 1 else tensor.uniform_(-0.5, 1.0)
    pixels = torch.randn(2, 3, CONFIG["image_size"], CONFIG["image_size"])
    with torch.no_grad():
        out = model(pixel_values=pixels, output_hidden_states=True)
    # under ComfyUI's clip_vision_h names (transformers 4 also saved them as vision_model.*)
    tensors = {f"weights.vision_model.{k.removeprefix('vision_model.')}": v.contiguous()
               for k, v in model.state_dict().items()}
    tensors["input.pixels"] = pixels
    tensors["output.penultimate"] = out.hidden_states[-2].contiguous()
    metadata = {"config": json.dumps(CONFIG), "reference": f"transformers "
                f"{transformers.__version__} CLIPVisionModel, hidden_states[-2], float32 CPU"}
    save_file(tensors, argv[0], metadata=metadata)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
