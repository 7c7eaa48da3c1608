"""TeaCache's decisions as its reference code makes them, on seeded synthetic sampling runs: the
data tests/test_teacache.py replays through sampling/teacache.py and sampling/residual_cache.py.

    python -m wan_enhanced.conformance.make_teacache_reference --mirror PATH \
        --out tests/data/teacache

PATH: a git mirror of github.com/ali-vilab/TeaCache (a bare repository). From its
TeaCache4Wan2.1/teacache_generate.py, `teacache_forward` is executed as the forward of a
stand-in model (conformance/cache_reference.py), and generate()'s own TeaCache setup statements
(counter, thresholds, retention and cutoff steps, the coefficients picked by checkpoint folder
name) are executed against it, as the script sets up a run. Each run is an Euler integration in
which every step calls the model for the conditional branch, then the unconditional one (the
reference's even and odd calls); guidance combines them (cfg 1: the conditional output alone).

Written: reference.json (per run: its settings, the coefficients the reference picked, the calls
whose blocks it skipped as [step, branch], branch 0 conditional) and reference.safetensors (each
run's final sample).
"""

from __future__ import annotations

import sys
import types

import torch

from .cache_reference import (StandIn, git_source, inputs, load_function, mirror_and_out,
                              reference_globals, reference_run, run_statements, statements,
                              write_reference)

SOURCE = "TeaCache4Wan2.1/teacache_generate.py"
# table key -> (the reference's pipeline variable, a checkpoint folder name that picks it)
MODELS = {
    "wan2.1-t2v-1.3b": ("wan_t2v", "Wan2.1-T2V-1.3B"),
    "wan2.1-t2v-14b": ("wan_t2v", "Wan2.1-T2V-14B"),
    "wan2.1-i2v-14b-480p": ("wan_i2v", "Wan2.1-I2V-14B-480P"),
    "wan2.1-i2v-14b-720p": ("wan_i2v", "Wan2.1-I2V-14B-720P"),
}
# (name, table, use_ret_steps, cfg, threshold, steps, shift, seed)
RUNS = (
    ("t2v13_cfg5", "wan2.1-t2v-1.3b", False, 5.0, 0.3, 30, 5.0, 0),
    ("t2v13_ret_cfg1", "wan2.1-t2v-1.3b", True, 1.0, 0.2, 30, 5.0, 1),
    ("t2v14_cfg5", "wan2.1-t2v-14b", False, 5.0, 0.2, 25, 5.0, 2),
    ("t2v14_ret_cfg5", "wan2.1-t2v-14b", True, 5.0, 0.3, 30, 8.0, 3),
    ("i2v480_cfg1", "wan2.1-i2v-14b-480p", False, 1.0, 0.26, 30, 3.0, 4),
    ("i2v480_ret_cfg5", "wan2.1-i2v-14b-480p", True, 5.0, 0.3, 20, 3.0, 5),
    ("i2v720_cfg5", "wan2.1-i2v-14b-720p", False, 5.0, 0.3, 40, 5.0, 6),
    ("i2v720_ret_cfg3", "wan2.1-i2v-14b-720p", True, 3.0, 0.2, 30, 5.0, 7),
    ("t2v14_low_threshold", "wan2.1-t2v-14b", False, 5.0, 0.05, 30, 5.0, 8),
)


def reference_model(source: str, table: str, use_ret_steps: bool, threshold: float,
                    steps: int, seed: int):
    """A stand-in whose forward is the reference's teacache_forward, set up by generate()'s
    TeaCache statements for `table`."""
    namespace = reference_globals()
    forward = load_function(source, "teacache_forward", namespace)
    model = type("ReferenceModel", (StandIn,), {})(seed)  # class attributes: this run's own
    pipeline, folder = MODELS[table]
    setup = statements(source, "generate", lambda text: text.startswith(
        f"{pipeline}.model.__class__") or (text.startswith("if args.use_ret_steps")
                                           and pipeline in text))
    run_statements(setup, {pipeline: types.SimpleNamespace(model=model),
                           "teacache_forward": forward,
                           "args": types.SimpleNamespace(
                               sample_steps=steps, teacache_thresh=threshold,
                               use_ret_steps=use_ret_steps, ckpt_dir=folder)}, "setup")
    return model


def block_calls(model) -> list[int]:
    """A list that gets one entry per run of the model's first block."""
    calls = []
    model.blocks[0].register_forward_hook(lambda *_: calls.append(1))
    return calls


def run_reference(source: str, run: tuple) -> tuple[dict, torch.Tensor]:
    name, table, use_ret_steps, cfg, threshold, steps, shift, seed = run
    model = reference_model(source, table, use_ret_steps, threshold, steps, seed)
    tensors = inputs(seed)
    ran = block_calls(model)
    final, skipped = reference_run(lambda step: model, tensors, ran, cfg, steps, shift)
    record = {"name": name, "table": table, "use_ret_steps": use_ret_steps, "cfg": cfg,
              "threshold": threshold, "steps": steps, "shift": shift, "seed": seed,
              "coefficients": [float(c) for c in type(model).coefficients],
              "skipped": skipped}
    return record, final


def main(argv=None) -> int:
    args = mirror_and_out(__doc__, argv)
    source, commit = git_source(args.mirror, SOURCE)
    records, finals = [], {}
    for run in RUNS:
        record, final = run_reference(source, run)
        records.append(record)
        finals[f"{record['name']}.final"] = final.contiguous()
        print(record["name"], "skipped", len(record["skipped"]), "of", 2 * record["steps"])
    write_reference(args.out, f"ali-vilab/TeaCache {commit} {SOURCE}", records, finals)
    return 0


if __name__ == "__main__":
    sys.exit(main())
