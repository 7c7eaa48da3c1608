"""What the TeaCache and MagCache reference scripts (make_teacache_reference.py,
make_magcache_reference.py) share: reading the reference code from its git mirror, running
parts of it, a small stand-in diffusion model with the official Wan model's forward interface,
and the Euler driver both sides run.

The reference code is never copied here: its functions and its setup statements are read from
the mirror (`git show`), parsed, and executed against the stand-in at generation time.

The stand-in has the attributes the references' forwards use (patch_embedding, time_embedding,
time_projection, text_embedding, blocks, head, unpatchify, ...), with seeded random weights; its
blocks take the official keyword arguments. `StandIn.ours` is the same model computed the way
our DiT hands its blocks to a step cache (wan/dit.py BlockStackHook), which the tests replay.
"""

from __future__ import annotations

import ast
import contextlib
import math
import subprocess
import types
from pathlib import Path

import torch
import torch.nn as nn

from ..sampling.schedules import shift_sigmas
from ..wan.dit import sinusoidal_embedding

SHAPE = (1, 4, 2, 8, 8)  # [B, C, F, H, W]; patches 1 x 2 x 2: 32 tokens
PATCH = (1, 2, 2)
DIM, FREQ_DIM, TEXT_DIM, TEXT_LEN, LAYERS = 32, 16, 8, 4, 2
SLOW_FREQUENCIES = 3  # of FREQ_DIM / 2: the time embedding reads the others


# -- the reference code ------------------------------------------------------------------------

def git_source(mirror: Path, path: str) -> tuple[str, str]:
    """(text of `path` at the mirror's HEAD, the commit)."""
    run = ["git", f"--git-dir={mirror}"]
    commit = subprocess.run([*run, "rev-parse", "HEAD"], check=True, capture_output=True,
                            text=True).stdout.strip()
    text = subprocess.run([*run, "show", f"HEAD:{path}"], check=True, capture_output=True,
                          text=True).stdout
    return text, commit


def function_node(source: str, name: str) -> ast.FunctionDef:
    for node in ast.parse(source).body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return node
    raise LookupError(f"no function {name} in the reference file")


def load_function(source: str, name: str, namespace: dict):
    """The reference's module-level function `name`, executed in `namespace`."""
    module = ast.Module(body=[function_node(source, name)], type_ignores=[])
    exec(compile(module, f"<reference {name}>", "exec"), namespace)
    return namespace[name]


def statements(source: str, function: str, keep) -> list[ast.stmt]:
    """The statements anywhere inside `function` whose source text passes keep(text), in
    source order (a statement kept is not searched further)."""
    found = []

    def visit(body):
        for node in body:
            text = ast.get_source_segment(source, node) or ""
            if keep(text):
                found.append(node)
                continue
            for field in ("body", "orelse"):
                inner = getattr(node, field, None)
                if isinstance(inner, list):
                    visit(inner)
    visit(function_node(source, function).body)
    return found


def run_statements(nodes: list[ast.stmt], namespace: dict, label: str) -> None:
    exec(compile(ast.Module(body=nodes, type_ignores=[]), f"<reference {label}>", "exec"),
         namespace)


def reference_globals() -> dict:
    """What the reference functions find at module level: torch, numpy, Wan's sinusoid, and
    torch.cuda.amp's autocast (float32 there: a no-op on the CPU)."""
    import numpy as np

    return {"torch": torch, "np": np, "math": math,
            "amp": types.SimpleNamespace(autocast=lambda **_: contextlib.nullcontext()),
            "sinusoidal_embedding_1d": lambda dim, position: sinusoidal_embedding(position, dim)}


# -- the stand-in model ------------------------------------------------------------------------

class StandInBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.mix = nn.Linear(DIM, DIM)

    def forward(self, x, e, seq_lens, grid_sizes, freqs, context, context_lens):
        shift = e[..., 0, :]  # [B, D], or [B, L, D] per token (Wan2.2)
        if shift.dim() == 2:
            shift = shift[:, None]
        return x + 0.5 * torch.tanh(self.mix(x) + shift + context.mean(1, keepdim=True))


class StandInHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.out = nn.Linear(DIM, math.prod(PATCH) * SHAPE[1])

    def forward(self, x, e):
        if e.dim() == 2:
            e = e[:, None]
        return self.out(x * (1 + 0.1 * torch.tanh(e)))


class StandIn(nn.Module):
    """A small model with the official WanModel's forward interface (t2v)."""

    model_type = "t2v"

    def __init__(self, seed: int):
        super().__init__()
        self.dim, self.freq_dim, self.text_len, self.out_dim = DIM, FREQ_DIM, TEXT_LEN, SHAPE[1]
        self.patch_size = PATCH
        self.patch_embedding = nn.Conv3d(SHAPE[1], DIM, PATCH, stride=PATCH)
        self.time_embedding = nn.Sequential(nn.Linear(FREQ_DIM, DIM), nn.SiLU(),
                                            nn.Linear(DIM, DIM))
        self.time_projection = nn.Sequential(nn.SiLU(), nn.Linear(DIM, 6 * DIM))
        self.text_embedding = nn.Sequential(nn.Linear(TEXT_DIM, DIM), nn.GELU(approximate="tanh"),
                                            nn.Linear(DIM, DIM))
        self.blocks = nn.ModuleList(StandInBlock() for _ in range(LAYERS))
        self.head = StandInHead()
        self.freqs = torch.zeros(1)
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for param in self.parameters():
                fan_in = math.prod(param.shape[1:]) if param.dim() > 1 else 1
                param.copy_(torch.randn(param.shape, generator=gen) / math.sqrt(fan_in))
            # the time embedding reads the slow sinusoid frequencies only, so that it changes
            # from step to step by the few per cent a trained Wan's does
            half = FREQ_DIM // 2
            slow = torch.zeros(half)
            slow[SLOW_FREQUENCIES:] = 1.0
            self.time_embedding[0].weight.mul_(torch.cat([slow, slow]))

    def unpatchify(self, x, grid_sizes):
        out = []
        for u, grid in zip(x, grid_sizes.tolist()):
            u = u[:math.prod(grid)].view(*grid, *PATCH, self.out_dim)
            u = torch.einsum("fhwpqrc->cfphqwr", u)
            out.append(u.reshape(self.out_dim, *[g * p for g, p in zip(grid, PATCH)]))
        return out

    def ours(self, x, t, context, block_stack):
        """The same forward (batched tensors in and out), its blocks handed to `block_stack`
        as wan/dit.py hands them: (tokens, e [B, 1, D], e0 [B, 1, 6, D], run_blocks)."""
        tokens = self.patch_embedding(x)
        grid = torch.tensor(tokens.shape[2:], dtype=torch.long).expand(x.shape[0], 3)
        tokens = tokens.flatten(2).transpose(1, 2)
        e = self.time_embedding(sinusoidal_embedding(t, self.freq_dim).float())
        e0 = self.time_projection(e).unflatten(1, (6, self.dim))
        kwargs = dict(e=e0, seq_lens=None, grid_sizes=grid, freqs=self.freqs,
                      context=self.text_embedding(context), context_lens=None)

        def run_blocks(tokens):
            for block in self.blocks:
                tokens = block(tokens, **kwargs)
            return tokens
        tokens = block_stack(tokens, e[:, None], e0[:, None], run_blocks)
        return torch.stack(self.unpatchify(self.head(tokens, e), grid))


def inputs(seed: int) -> dict[str, torch.Tensor]:
    """A run's start sample and text rows (conditional, unconditional)."""
    gen = torch.Generator().manual_seed(1000 + seed)
    return {"x0": torch.randn(SHAPE, generator=gen),
            "cond": torch.randn(1, TEXT_LEN, TEXT_DIM, generator=gen),
            "uncond": torch.randn(1, TEXT_LEN, TEXT_DIM, generator=gen)}


def reference_call(model: nn.Module, x: torch.Tensor, t: torch.Tensor,
                   context: torch.Tensor) -> torch.Tensor:
    """One call of the reference forward as the official pipelines make it (lists in, the
    first output out), batched back to [1, C, F, H, W]."""
    tokens = math.prod(s // p for s, p in zip(SHAPE[2:], PATCH))
    return model([x[0]], t=t, context=[context[0]], seq_len=tokens)[0][None]


# -- the driver both sides run -----------------------------------------------------------------

def shifted_sigmas(steps: int, shift: float) -> torch.Tensor:
    """steps + 1 sigmas from 1 to 0, shifted as a flow model's."""
    base = torch.linspace(1.0, 0.0, steps + 1, dtype=torch.float64)
    return shift_sigmas(base, shift).to(torch.float32)


def euler_run(step_velocity, x0: torch.Tensor, sigmas: torch.Tensor) -> torch.Tensor:
    """x <- x + (sigma_next - sigma) v(x, step, t), t = 1000 sigma."""
    x = x0.clone()
    for i in range(len(sigmas) - 1):
        v = step_velocity(x, i, (sigmas[i] * 1000).view(1))
        x = x + (sigmas[i + 1] - sigmas[i]) * v
    return x


def guided(cond: torch.Tensor, uncond: torch.Tensor | None, cfg: float) -> torch.Tensor:
    """Guidance as sampling/guidance.py combines it (cfg 1: the conditional output alone)."""
    if cfg == 1:
        return cond
    return uncond + float(cfg) * (cond - uncond)


def reference_run(model_for_step, tensors: dict, ran: list, cfg: float, steps: int,
                  shift: float) -> tuple[torch.Tensor, list[list[int]]]:
    """A guided Euler run of the reference models (model_for_step(step): the one for that step),
    both branches every step as the reference scripts run them: the final sample, and the
    [step, branch] of every call that ran no block (`ran` gets an entry per first-block run)."""
    skipped = []

    def step_velocity(x, step, t):
        model = model_for_step(step)
        outs = []
        for branch, context in enumerate((tensors["cond"], tensors["uncond"])):
            before = len(ran)
            outs.append(reference_call(model, x, t, context))
            if len(ran) == before:
                skipped.append([step, branch])
        return guided(outs[0], outs[1], cfg)

    with torch.no_grad():
        final = euler_run(step_velocity, tensors["x0"], shifted_sigmas(steps, shift))
    return final, skipped


def mirror_and_out(doc: str, argv=None):
    """The reference scripts' arguments: --mirror (a bare git mirror of the reference
    repository) and --out (the folder the data goes to)."""
    import argparse

    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--mirror", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    return parser.parse_args(argv)


def write_reference(out: Path, reference: str, records: list[dict],
                    finals: dict[str, torch.Tensor]) -> None:
    """The runs' records (reference.json, naming the reference code) and their final samples
    (reference.safetensors) in `out`."""
    import json

    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    save_file(finals, str(out / "reference.safetensors"))
    (out / "reference.json").write_text(json.dumps(
        {"reference": reference, "runs": records}, indent=1) + "\n")
