"""Writes the key manifest of a LoRA made by LightX2V's own extractor (tests/data/lora/
lightx2v_keys.json): the exact keys, shapes and dtypes its tool writes for a Wan2.1 T2V 1.3B
model, two blocks deep, at the real widths.

    python conformance/make_lightx2v_manifest.py LIGHTX2V_DIR tests/data/lora/lightx2v_keys.json [--commit SHA]

LIGHTX2V_DIR is a checkout of LightX2V (github.com/ModelTC/LightX2V), or any folder holding its
tools/extract/lora_extractor.py (e.g. exported from a bare mirror with `git show
HEAD:tools/extract/lora_extractor.py`); the extractor is loaded from there by path and nothing
of it is copied into this package. Its imports (torch, safetensors, tqdm) must be installed.
The commit named in the manifest is LIGHTX2V_DIR's `git rev-parse HEAD`, or --commit for an
exported folder.

The source model is this package's random_dit_state (seed 0, float32, official key names) of
wan2.1-t2v-1.3b with num_layers=2; the target is the same with a seeded perturbation (1e-3 unit
noise, seed 1) added to every tensor, so every parameter differs. The two go through
LightX2V's extract_lora_from_diff(source, target, rank=64, diff_only=False) (2-D weights of
at least 1e6 elements as SVD `lora_up`/`lora_down` pairs, everything else as `.diff`,
`.diff_b` or `.diff_m`) and then its save_lora_weights with the command line's defaults
(safetensors, bf16) into a temporary folder; the manifest lists that file's keys as
{key: [shape, dtype]}, sorted. Needs about 1.5 GB of memory and a minute on a CPU (the
extractor uses a GPU for its SVDs when there is one).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

CONFIG_NAME = "wan2.1-t2v-1.3b"
NUM_LAYERS = 2
RANK = 64
PERTURBATION = 1e-3


def _import_extractor(lightx2v_dir: Path):
    path = lightx2v_dir / "tools" / "extract" / "lora_extractor.py"
    if not path.is_file():
        raise SystemExit(f"{path} not found: LIGHTX2V_DIR must hold LightX2V's "
                         f"tools/extract/lora_extractor.py")
    spec = importlib.util.spec_from_file_location("lightx2v_lora_extractor", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _commit(lightx2v_dir: Path, given: str | None) -> str:
    if given:
        return given
    found = subprocess.run(["git", "-C", str(lightx2v_dir), "rev-parse", "HEAD"],
                           capture_output=True, text=True).stdout.strip()
    return found or "unknown commit"


def _write(manifest: dict, out: Path) -> None:
    # one key a line: small, and readable in a diff
    lines = ["{",
             f' "source": {json.dumps(manifest["source"])},',
             f' "config": {json.dumps(manifest["config"])},',
             f' "saved_by": {json.dumps(manifest["saved_by"])},',
             ' "keys": {']
    items = sorted(manifest["keys"].items())
    for i, (key, entry) in enumerate(items):
        lines.append(f"  {json.dumps(key)}: {json.dumps(entry)}"
                     + ("," if i < len(items) - 1 else ""))
    lines += [" }", "}", ""]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines))


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("lightx2v_dir", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--commit", help="LightX2V's commit, for a folder that is no checkout")
    args = parser.parse_args(argv)

    extractor = _import_extractor(args.lightx2v_dir)
    import torch
    from safetensors import safe_open

    from wan_enhanced.checkpoints.tiny import random_dit_state
    from wan_enhanced.wan.configs import KNOWN_DITS

    config = replace(KNOWN_DITS[CONFIG_NAME].config, num_layers=NUM_LAYERS)
    source = random_dit_state(config, seed=0)
    gen = torch.Generator().manual_seed(1)
    target = {}
    for key, value in source.items():
        noise = torch.randn(value.shape, generator=gen, dtype=torch.float32)
        target[key] = value + noise.mul_(PERTURBATION)
        del noise

    lora = extractor.extract_lora_from_diff(source, target, rank=RANK, diff_only=False)
    del source, target
    keys = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "lora.safetensors"
        extractor.save_lora_weights(lora, str(path), "safetensors", "bf16")
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for key in f.keys():
                tensor = f.get_tensor(key)
                keys[key] = [list(tensor.shape), str(tensor.dtype).removeprefix("torch.")]

    commit = _commit(args.lightx2v_dir, args.commit)
    manifest = {
        "source": f"LightX2V {commit} tools/extract/lora_extractor.py "
                  f"extract_lora_from_diff(rank={RANK})",
        "config": f"{CONFIG_NAME}, num_layers={NUM_LAYERS}",
        "saved_by": "save_lora_weights(output_format='safetensors', output_dtype='bf16')",
        "keys": keys,
    }
    _write(manifest, args.out)
    print(f"{args.out}: {len(keys)} keys")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
