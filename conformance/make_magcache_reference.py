"""MagCache's decisions as its reference code makes them, on seeded synthetic sampling runs: the
data tests/test_magcache.py replays through sampling/magcache.py and sampling/residual_cache.py.

    python -m wan_enhanced.conformance.make_magcache_reference --mirror PATH \\
        --out tests/data/magcache

PATH: a git mirror of github.com/Zehong-Ma/MagCache (a bare repository). Wan2.1 runs: from
MagCache4Wan2.1/magcache_generate.py, `magcache_forward` is executed as the forward of a
stand-in model (conformance/cache_reference.py) and generate()'s `if args.use_magcache:` block
of the T2V or I2V pipeline is executed against it (counter, threshold, K, retention, the table
picked by checkpoint folder name, its nearest-entry resampling). Wan2.2 runs: from
MagCache4Wan2.2/magcache_generate.py, its `magcache_forward`, `init_magcache`, `get_timesteps`
and generate()'s `if args.use_magcache:` block of the T2V-A14B, I2V-A14B or TI2V-5B pipeline;
an A14B run has two stand-ins (the experts) of one class, which share the reference's class
state as the official experts do, switched after the high-noise step count that block computes.
For TI2V-5B the reference's init_magcache multiplies a None split (split_steps * 2) and fails;
the harness gives it 0 and then sets the split to None, the forward's TI2V case.

Every step calls the model for the conditional branch, then the unconditional one (the
reference's even and odd calls); guidance combines them (cfg 1: the conditional output alone).

Written: reference.json (per run: its settings, the per-call ratios the reference used, the
high-noise step count of A14B runs, the calls whose blocks it skipped as [step, branch]) and
reference.safetensors (each run's final sample).
"""

from __future__ import annotations

import sys
import types
from typing import List, Optional, Tuple, Union

import torch

from .cache_reference import (StandIn, git_source, inputs, load_function, mirror_and_out,
                              reference_globals, reference_run, run_statements, statements,
                              write_reference)

SOURCES = {"wan2.1": "MagCache4Wan2.1/magcache_generate.py",
           "wan2.2": "MagCache4Wan2.2/magcache_generate.py"}
# table key -> (family, the reference's pipeline variable, checkpoint folder, A14B boundary,
# TI2V start image)
MODELS = {
    "wan2.1-t2v-1.3b": ("wan2.1", "wan_t2v", "Wan2.1-T2V-1.3B", None, None),
    "wan2.1-t2v-14b": ("wan2.1", "wan_t2v", "Wan2.1-T2V-14B", None, None),
    "wan2.1-i2v-14b-480p": ("wan2.1", "wan_i2v", "Wan2.1-I2V-14B-480P", None, None),
    "wan2.1-i2v-14b-720p": ("wan2.1", "wan_i2v", "Wan2.1-I2V-14B-720P", None, None),
    "wan2.2-t2v-a14b": ("wan2.2", "wan_t2v", "Wan2.2-T2V-A14B", 0.875, None),
    "wan2.2-i2v-a14b": ("wan2.2", "wan_i2v", "Wan2.2-I2V-A14B", 0.900, None),
    "wan2.2-ti2v-5b-t2v": ("wan2.2", "wan_ti2v", "Wan2.2-TI2V-5B", None, False),
    "wan2.2-ti2v-5b-i2v": ("wan2.2", "wan_ti2v", "Wan2.2-TI2V-5B", None, True),
}
# (name, table, cfg, threshold, K, retention_ratio, steps, shift, seed)
RUNS = (
    ("t2v13_table_steps", "wan2.1-t2v-1.3b", 5.0, 0.12, 2, 0.2, 50, 5.0, 0),
    ("t2v13_k4_cfg1", "wan2.1-t2v-1.3b", 1.0, 0.12, 4, 0.2, 30, 5.0, 1),
    ("t2v14_e024_k6", "wan2.1-t2v-14b", 5.0, 0.24, 6, 0.2, 50, 5.0, 2),
    ("t2v14_23_steps", "wan2.1-t2v-14b", 5.0, 0.12, 2, 0.2, 23, 5.0, 3),
    ("i2v480_table_steps", "wan2.1-i2v-14b-480p", 5.0, 0.24, 6, 0.2, 40, 3.0, 4),
    ("i2v720_cfg1", "wan2.1-i2v-14b-720p", 1.0, 0.12, 4, 0.2, 25, 5.0, 5),
    ("t2v_a14b_r04", "wan2.2-t2v-a14b", 4.0, 0.06, 2, 0.4, 40, 12.0, 6),
    ("t2v_a14b_27_steps", "wan2.2-t2v-a14b", 3.0, 0.04, 2, 0.2, 27, 5.0, 7),
    ("i2v_a14b_r01", "wan2.2-i2v-a14b", 3.5, 0.06, 2, 0.1, 40, 5.0, 8),
    ("i2v_a14b_cfg1", "wan2.2-i2v-a14b", 1.0, 0.04, 2, 0.2, 30, 5.0, 9),
    ("ti2v_t2v", "wan2.2-ti2v-5b-t2v", 5.0, 0.06, 2, 0.2, 50, 5.0, 10),
    ("ti2v_i2v_33_steps", "wan2.2-ti2v-5b-i2v", 5.0, 0.04, 2, 0.2, 33, 5.0, 11),
)


def reference_models(sources: dict, run: tuple) -> tuple[list, int | None]:
    """The stand-ins with the reference's forward and setup for `run`: one, or an A14B pair
    (high-noise first) with the high-noise step count the reference computed."""
    _, table, _, threshold, k, retention, steps, shift, seed = run
    family, pipeline, folder, boundary, start_image = MODELS[table]
    source = sources[family]
    namespace = reference_globals()
    namespace.update(Optional=Optional, List=List, Tuple=Tuple, Union=Union)
    forward = load_function(source, "magcache_forward", namespace)
    cls = type("ReferenceModel", (StandIn,), {})  # class attributes: this run's own
    models = [cls(seed), cls(100 + seed)] if boundary is not None else [cls(seed)]
    args = types.SimpleNamespace(use_magcache=True, sample_steps=steps, sample_shift=shift,
                                 magcache_thresh=threshold, magcache_K=k,
                                 retention_ratio=retention, ckpt_dir=folder)
    scope = {"args": args, "magcache_forward": forward, **namespace}
    if family == "wan2.1":
        scope["nearest_interp"] = load_function(source, "nearest_interp", namespace)
        scope[pipeline] = types.SimpleNamespace(model=models[0])
    else:
        for name in ("nearest_interp", "get_timesteps", "init_magcache"):
            scope[name] = load_function(source, name, namespace)
        reference_init = scope["init_magcache"]

        def init_magcache(model, mag_ratios, args, split_steps=None, mode="t2v"):
            reference_init(model, mag_ratios, args, 0 if split_steps is None else split_steps,
                           mode)
            if split_steps is None:
                model.__class__.split_step = None
        scope["init_magcache"] = init_magcache
        scope["cfg"] = types.SimpleNamespace(num_train_timesteps=1000, boundary=boundary)
        scope["img"] = object() if start_image else None
        scope[pipeline] = types.SimpleNamespace(model=models[0], high_noise_model=models[0],
                                                low_noise_model=models[-1])
    setup = statements(source, "generate", lambda text: text.startswith(
        "if args.use_magcache") and f"{pipeline}." in text)
    run_statements(setup[:1], scope, "setup")
    split = None
    if boundary is not None:
        split = cls.split_step // 2
    return models, split


def run_reference(sources: dict, run: tuple) -> tuple[dict, torch.Tensor]:
    name, table, cfg, threshold, k, retention, steps, shift, seed = run
    models, split = reference_models(sources, run)
    tensors = inputs(seed)
    ran = []
    for model in models:
        model.blocks[0].register_forward_hook(lambda *_: ran.append(1))
    ratios = [float(r) for r in type(models[0]).mag_ratios]
    final, skipped = reference_run(
        lambda step: models[0] if split is None or step < split else models[-1], tensors, ran,
        cfg, steps, shift)
    record = {"name": name, "table": table, "cfg": cfg, "threshold": threshold, "K": k,
              "retention_ratio": retention, "steps": steps, "shift": shift, "seed": seed,
              "high_noise_steps": split, "ratios": ratios, "skipped": skipped}
    return record, final


def main(argv=None) -> int:
    args = mirror_and_out(__doc__, argv)
    sources, commit = {}, None
    for family, path in SOURCES.items():
        sources[family], commit = git_source(args.mirror, path)
    records, finals = [], {}
    for run in RUNS:
        record, final = run_reference(sources, run)
        records.append(record)
        finals[f"{record['name']}.final"] = final.contiguous()
        print(record["name"], "split", record["high_noise_steps"], "skipped",
              len(record["skipped"]), "of", 2 * record["steps"])
    write_reference(args.out, f"Zehong-Ma/MagCache {commit} {', '.join(SOURCES.values())}",
                    records, finals)
    return 0


if __name__ == "__main__":
    sys.exit(main())
