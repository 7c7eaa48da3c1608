"""One module's keys of a LoRA file made into patches (lora/patches.py), every shape checked
against the parameter it changes from the file's header alone: a mismatch names the file, the
key, both shapes and what was expected, before any weight is touched.
"""

from __future__ import annotations

import math
from typing import Iterator, Mapping

import torch

from ..checkpoints.reader import CheckpointError, TensorSource
from .formats import LoraKey
from .keymap import ModelNames
from .patches import (Additive, Butterfly, Decomposed, Difference, Generalized, Hadamard,
                      Kronecker, LowRank, Orthogonal, Patch, Replacement, glora_delta)


class LoraError(CheckpointError):
    """A LoRA file that cannot be applied; the message names the file and the key."""


_PAIR = {"up", "down"}
_LOHA = {"hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b"}
_LOKR = {"lokr_w1", "lokr_w1_a", "lokr_w1_b", "lokr_w2", "lokr_w2_a", "lokr_w2_b", "lokr_t2"}
_DORA = ("dora_scale", "magnitude")
_GLORA = ("glora_a1", "glora_a2", "glora_b1", "glora_b2")


def module_patches(source: TensorSource, names: ModelNames, shapes: Mapping[str, tuple],
                   module: str, ours: str, roles: dict[str, LoraKey]
                   ) -> Iterator[tuple[str | None, Patch]]:
    """(target parameter or None when the model has none, patch) for each patch the keys of
    one module make; raises LoraError for keys that contradict each other or the model."""
    path = source.path
    weight_kinds = [kind for kind, found in (
        ("a low-rank pair", _PAIR & set(roles)), ("LoHa factors", _LOHA & set(roles)),
        ("LoKr factors", _LOKR & set(roles)), ("OFT blocks", {"oft_blocks"} & set(roles)),
        ("GLoRA factors", set(_GLORA) & set(roles)),
        ("a full difference", {"diff"} & set(roles)),
        ("a weight replacement", {"set_weight"} & set(roles)))
        if found]
    if len(weight_kinds) > 1:
        shown = ", ".join(repr(k.key) for k in roles.values())
        raise LoraError(f"{path}: module {module!r} has both {weight_kinds[0]} and "
                        f"{weight_kinds[1]} ({shown}); which one applies is ambiguous")
    extras = {"alpha": "an alpha", "up_bias": "a lora_B bias", "dora_scale": "a DoRA scale",
              "magnitude": "a DoRA magnitude"}
    if not weight_kinds or weight_kinds in (["a full difference"], ["a weight replacement"]):
        for role, what in extras.items():
            if role in roles:
                raise LoraError(f"{path}: {roles[role].key!r} is {what} without the low-rank "
                                f"pair, LoHa or LoKr factors of its module")
    target = names.target(ours, "up")
    butterfly = "oft_blocks" in roles and len(source.shape(roles["oft_blocks"].key)) == 4
    if "oft_rescale" in roles and not butterfly:
        raise LoraError(f"{path}: {roles['oft_rescale'].key!r} is OFT's output rescaling, which "
                        f"ComfyUI leaves out when it merges OFT; refused rather than ignored "
                        f"(merge the file without it)")
    if "oft_blocks" in roles or set(_GLORA) & set(roles):
        for role in ("dora_scale", "magnitude", "up_bias"):
            if role in roles:
                raise LoraError(f"{path}: {roles[role].key!r} beside OFT, BOFT or GLoRA factors: "
                                f"DoRA and lora_B biases belong to low-rank, LoHa or LoKr "
                                f"patches")
        if butterfly:
            yield target, _boft(source, shapes, target, roles)
        elif "oft_blocks" in roles:
            yield target, _oft(source, shapes, target, roles)
        else:
            yield target, _glora(source, shapes, target, roles)
    inner: Additive | None = None
    if _PAIR & set(roles):
        inner = _low_rank(source, shapes, target, roles)
    elif _LOHA & set(roles):
        inner = _loha(source, shapes, target, roles)
    elif _LOKR & set(roles):
        inner = _lokr(source, shapes, target, roles)
    if inner is not None:
        dora = [roles[r] for r in _DORA if r in roles]
        if len(dora) > 1:
            raise LoraError(f"{path}: module {module!r} has both {dora[0].key!r} and "
                            f"{dora[1].key!r}; one DoRA scale per module")
        yield target, (_dora(source, shapes, target, inner, dora[0]) if dora else inner)
        if "up_bias" in roles:
            if not isinstance(inner, LowRank):
                raise LoraError(f"{path}: {roles['up_bias'].key!r} is a lora_B bias beside "
                                f"LoHa/LoKr factors; it belongs to a low-rank pair")
            bias = names.target(ours, "diff_b")
            yield bias, _difference(source, shapes, bias, roles["up_bias"].key, inner.scale)
    if "diff" in roles:
        diff = names.target(ours, "diff")
        yield diff, _difference(source, shapes, diff, roles["diff"].key)
    if "set_weight" in roles:
        weight = names.target(ours, "diff")
        key = roles["set_weight"].key
        yield weight, Replacement(_difference(source, shapes, weight, key).key)
    if "diff_b" in roles:
        bias = names.target(ours, "diff_b")
        yield bias, _difference(source, shapes, bias, roles["diff_b"].key)


def _need(roles: dict[str, LoraKey], role: str, source, have: str) -> str:
    if role not in roles:
        raise LoraError(f"{source.path}: {have!r} has no partner: the file lacks its "
                        f"{role.replace('up', 'lora_up / lora_B').replace('down', 'lora_down / lora_A')} key")
    return roles[role].key


def _low_rank(source, shapes, target, roles) -> LowRank:
    have = next(roles[r].key for r in ("up", "down") if r in roles)
    up, down = _need(roles, "up", source, have), _need(roles, "down", source, have)
    _floats(source, up, down)
    rank = _dim(source, down, 0)
    scale = _scale(source, roles, rank)
    if target is not None:
        expected = tuple(shapes[target])
        up_shape, down_shape = source.shape(up), source.shape(down)
        rows, per_row = expected[0], math.prod(expected[1:])
        if len(up_shape) < 2 or up_shape[0] != rows:
            _mismatch(source, up, up_shape, target, expected, f"[{rows}, rank]")
        if len(down_shape) < 2 or math.prod(down_shape[1:]) != per_row:
            _mismatch(source, down, down_shape, target, expected, f"[rank, {per_row}]")
        if math.prod(up_shape[1:]) != down_shape[0]:
            raise LoraError(f"{source.path}: {up!r} {list(up_shape)} and {down!r} "
                            f"{list(down_shape)} disagree on the rank")
    return LowRank(up, down, rank, scale)


def _loha(source, shapes, target, roles) -> Hadamard:
    have = next(roles[r].key for r in sorted(_LOHA) if r in roles)
    keys = {r: _need(roles, r, source, have) for r in sorted(_LOHA)}
    cores = {r: roles[r].key if r in roles else None for r in ("hada_t1", "hada_t2")}
    if (cores["hada_t1"] is None) != (cores["hada_t2"] is None):
        present = cores["hada_t1"] or cores["hada_t2"]
        raise LoraError(f"{source.path}: {present!r} is one LoHa Tucker core; its module "
                        f"needs both hada_t1 and hada_t2")
    _floats(source, *keys.values(), *[k for k in cores.values() if k])
    rank = _dim(source, keys["hada_w1_b"], 0)
    patch = Hadamard(keys["hada_w1_a"], keys["hada_w1_b"], keys["hada_w2_a"],
                     keys["hada_w2_b"], cores["hada_t1"], cores["hada_t2"], rank,
                     _scale(source, roles, rank))
    if target is not None:
        expected = tuple(shapes[target])
        for a, b, core in ((patch.w1_a, patch.w1_b, patch.t1), (patch.w2_a, patch.w2_b,
                                                                  patch.t2)):
            _check_factor_pair(source, a, b, core, target, expected)
    return patch


def _check_factor_pair(source, a: str, b: str, core: str | None, target: str,
                       expected: tuple) -> None:
    """A product a @ b (or a Tucker core with a, b) that must make the whole weight."""
    a_shape, b_shape = tuple(source.shape(a)), tuple(source.shape(b))
    if core is None:
        made = (a_shape[0], math.prod(b_shape[1:])) if len(a_shape) == 2 and b_shape else None
        inner_ok = len(a_shape) == 2 and len(b_shape) >= 2 and a_shape[1] == b_shape[0]
        if not inner_ok or made != (expected[0], math.prod(expected[1:])):
            raise LoraError(f"{source.path}: {a!r} {list(a_shape)} times {b!r} {list(b_shape)} "
                            f"does not make the model's {target} {list(expected)}: expected "
                            f"[{expected[0]}, rank] and [rank, {math.prod(expected[1:])}]")
        return
    c_shape = tuple(source.shape(core))
    ok = (len(a_shape) == 2 and len(b_shape) == 2 and len(c_shape) >= 2
          and (a_shape[1], b_shape[1], *c_shape[2:]) == expected
          and c_shape[:2] == (a_shape[0], b_shape[0]))
    if not ok:
        raise LoraError(f"{source.path}: the Tucker core {core!r} {list(c_shape)} with {a!r} "
                        f"{list(a_shape)} and {b!r} {list(b_shape)} does not make the model's "
                        f"{target} {list(expected)}: expected the core [r1, r2, "
                        f"{', '.join(map(str, expected[2:]))}], [r1, {expected[0]}] and "
                        f"[r2, {expected[1] if len(expected) > 1 else '?'}]")


def _lokr(source, shapes, target, roles) -> Kronecker:
    key = {r: roles[r].key if r in roles else None for r in sorted(_LOKR)}
    have = next(k for k in key.values() if k)
    for side in ("w1", "w2"):
        whole, a, b = key[f"lokr_{side}"], key[f"lokr_{side}_a"], key[f"lokr_{side}_b"]
        if whole is None and (a is None or b is None):
            missing = f"lokr_{side}" if a is None and b is None else \
                f"lokr_{side}_{'b' if b is None else 'a'}"
            raise LoraError(f"{source.path}: {have!r} is a LoKr factor whose module lacks "
                            f"{missing} (each side is lokr_{side} or lokr_{side}_a with "
                            f"lokr_{side}_b)")
        if whole is not None and (a or b):
            raise LoraError(f"{source.path}: {whole!r} and {(a or b)!r} both give LoKr's "
                            f"{side}; which one applies is ambiguous")
    if key["lokr_t2"] is not None and key["lokr_w2"] is not None:
        raise LoraError(f"{source.path}: {key['lokr_t2']!r} is a Tucker core beside a whole "
                        f"lokr_w2")
    _floats(source, *[k for k in key.values() if k])
    # the scale's rank: w2's decomposition, else w1's (ComfyUI's order), else none
    rank = (_dim(source, key["lokr_w2_b"], 0) if key["lokr_w2_b"] else
            _dim(source, key["lokr_w1_b"], 0) if key["lokr_w1_b"] else None)
    scale = _scale(source, roles, rank) if rank else 1.0
    if rank is None and "alpha" in roles:
        _alpha(source, roles["alpha"].key)  # checked, and unused as ComfyUI leaves it
    patch = Kronecker(key["lokr_w1"], key["lokr_w1_a"], key["lokr_w1_b"], key["lokr_w2"],
                      key["lokr_w2_a"], key["lokr_w2_b"], key["lokr_t2"], rank, scale)
    if target is not None:
        _check_kronecker(source, patch, target, tuple(shapes[target]))
    return patch


def _check_kronecker(source, patch: Kronecker, target: str, expected: tuple) -> None:
    def fail(detail: str):
        raise LoraError(f"{source.path}: the LoKr factors of {target} ({detail}) do not make "
                        f"its shape {list(expected)}")
    if patch.w1 is not None:
        w1 = tuple(source.shape(patch.w1))
    else:
        a, b = tuple(source.shape(patch.w1_a)), tuple(source.shape(patch.w1_b))
        if len(a) != 2 or len(b) != 2 or a[1] != b[0]:
            fail(f"{patch.w1_a!r} {list(a)} times {patch.w1_b!r} {list(b)}")
        w1 = (a[0], b[1])
    if len(w1) != 2 or len(expected) < 2 or expected[0] % w1[0] or expected[1] % w1[1]:
        fail(f"w1 {list(w1)} does not divide [{expected[0]}, {expected[1:2]}]")
    rows, cols, kernel = expected[0] // w1[0], expected[1] // w1[1], expected[2:]
    if patch.w2 is not None:
        w2 = tuple(source.shape(patch.w2))
        if math.prod(w2) != rows * cols * math.prod(kernel) or w2[0] != rows:
            fail(f"{patch.w2!r} {list(w2)}, expected [{rows}, {cols}"
                 f"{''.join(f', {k}' for k in kernel)}]")
    elif patch.t2 is not None:
        a, b, c = (tuple(source.shape(k)) for k in (patch.w2_a, patch.w2_b, patch.t2))
        if not (len(a) == 2 and len(b) == 2 and c[:2] == (a[0], b[0])
                and (a[1], b[1], *c[2:]) == (rows, cols, *kernel)):
            fail(f"Tucker core {patch.t2!r} {list(c)} with {list(a)} and {list(b)}")
    else:
        a, b = tuple(source.shape(patch.w2_a)), tuple(source.shape(patch.w2_b))
        if not (len(a) == 2 and len(b) >= 2 and a[1] == b[0] and a[0] == rows
                and math.prod(b[1:]) == cols * math.prod(kernel)):
            fail(f"{patch.w2_a!r} {list(a)} times {patch.w2_b!r} {list(b)}, expected "
                 f"[{rows}, rank] and [rank, {cols * math.prod(kernel)}]")


def _oft(source, shapes, target, roles) -> Orthogonal:
    key = roles["oft_blocks"].key
    _floats(source, key)
    have = tuple(source.shape(key))
    constraint = _alpha(source, roles["alpha"].key) if "alpha" in roles else 0.0
    if target is not None:
        rows = shapes[target][0]
        if len(have) != 3 or have[1] != have[2] or have[0] * have[1] != rows:
            raise LoraError(f"{source.path}: {key!r} has shape {list(have)} but the model's "
                            f"{target} has {rows} output rows: OFT blocks are [k, n, n] with "
                            f"k * n = {rows}")
    return Orthogonal(key, constraint)


def _boft(source, shapes, target, roles) -> Butterfly:
    key = roles["oft_blocks"].key
    rescale = roles["oft_rescale"].key if "oft_rescale" in roles else None
    _floats(source, key, *([rescale] if rescale else []))
    levels, count, size, other = source.shape(key)
    constraint = _alpha(source, roles["alpha"].key) if "alpha" in roles else 0.0
    if target is not None:
        rows = shapes[target][0]
        ok = (size == other and size % 2 == 0 and count * size == rows
              and rows % (2 ** max(levels - 1, 0) * size) == 0)
        if not ok:
            raise LoraError(f"{source.path}: {key!r} has shape {[levels, count, size, other]} but "
                            f"the model's {target} has {rows} output rows: BOFT blocks are "
                            f"[m, k, n, n] with n even, k * n = {rows} and {rows} a multiple "
                            f"of 2^(m-1) * n")
        if rescale is not None and math.prod(source.shape(rescale)) != rows:
            raise LoraError(f"{source.path}: {rescale!r} has shape {list(source.shape(rescale))}"
                            f"; BOFT's rescale has one value per output row ({rows})")
    return Butterfly(key, constraint, rescale)


def _glora(source, shapes, target, roles) -> Generalized:
    have = next(roles[r].key for r in _GLORA if r in roles)
    keys = [_need(roles, r, source, have) for r in _GLORA]
    _floats(source, *keys)
    a1, a2, b1, b2 = (tuple(source.shape(k)) for k in keys)
    weight = tuple(shapes[target]) if target is not None else ()
    # which layout, from the shapes, as ComfyUI decides it
    old, rank = False, None
    if len(a1) >= 2 and len(a2) >= 2 and len(b1) >= 2 and len(b2) >= 2:
        if b2[1] == b1[0] == a1[0] == a2[1]:
            old, rank = True, a1[0]
        if b2[0] == b1[1] == a1[1] == a2[0]:
            keeps_old = old and len(weight) >= 2 and a2[0] == weight[0] == weight[1]
            if not keeps_old:
                old, rank = False, a2[0]
    if rank is None:
        raise LoraError(f"{source.path}: the GLoRA factors {keys[0]!r} {list(a1)}, "
                        f"{keys[1]!r} {list(a2)}, {keys[2]!r} {list(b1)}, {keys[3]!r} "
                        f"{list(b2)} fit neither GLoRA layout")
    patch = Generalized(*keys, old, rank, _scale(source, roles, rank))
    if target is not None:  # the products on the meta device: their shapes, nothing computed
        meta = {k: torch.empty(shape, device="meta") for k, shape in zip(keys, (a1, a2, b1, b2))}
        try:
            made = tuple(glora_delta(torch.empty(weight, device="meta"), patch,
                                      meta.__getitem__).shape)
        except RuntimeError:
            made = None
        if made != weight:
            raise LoraError(f"{source.path}: the GLoRA factors of {target} ({keys[0]!r} "
                            f"{list(a1)}, {keys[1]!r} {list(a2)}, {keys[2]!r} {list(b1)}, "
                            f"{keys[3]!r} {list(b2)}) do not make its shape {list(weight)}")
    return patch


def _dora(source, shapes, target, inner: Additive, key: LoraKey) -> Decomposed:
    _floats(source, key.key)
    have = tuple(source.shape(key.key))
    if target is not None:
        expected = tuple(shapes[target])
        rows, cols = expected[0], expected[1] if len(expected) > 1 else 1
        if key.role == "magnitude":
            ok = math.prod(have) == rows and (len(have) == 1 or have[0] == rows)
            wanted = f"[{rows}] (one per output row)"
        else:
            ok = (math.prod(have) == rows and have[0] == rows) or (
                math.prod(have) == cols and len(have) >= 2 and have[0] == 1 and have[1] == cols)
            wanted = f"[{rows}, 1] (per output row) or [1, {cols}] (per input column)"
        if not ok:
            raise LoraError(f"{source.path}: {key.key!r} has shape {list(have)} but the "
                            f"model's {target} is {list(expected)}: a DoRA scale is {wanted}")
    return Decomposed(inner, key.key, "peft" if key.role == "magnitude" else "comfyui")


def _difference(source, shapes, target, key: str, scale: float = 1.0) -> Difference:
    if target is not None:
        _floats(source, key)
        have, expected = tuple(source.shape(key)), tuple(shapes[target])
        if have != expected:
            raise LoraError(f"{source.path}: {key!r} has shape {list(have)} but the model's "
                            f"{target} is {list(expected)} (a LoRA for another model size?)")
    return Difference(key, scale)


def _mismatch(source, key, have, target, expected, wanted) -> None:
    raise LoraError(f"{source.path}: {key!r} has shape {list(have)} but the model's {target} "
                    f"is {list(expected)}: expected {wanted} (a LoRA for another model size?)")


def _dim(source, key: str, axis: int) -> int:
    shape = source.shape(key)
    return shape[axis] if len(shape) > axis else 0


def _scale(source, roles, rank: int) -> float:
    alpha = _alpha(source, roles["alpha"].key) if "alpha" in roles else None
    return 1.0 if alpha is None or rank == 0 else alpha / rank


def _alpha(source: TensorSource, key: str) -> float:
    if math.prod(source.shape(key)) != 1:
        raise LoraError(f"{source.path}: {key!r} has shape {list(source.shape(key))}; an alpha "
                        f"is one number")
    _floats(source, key)
    value = float(source.read(key).reshape(()).item())
    if not math.isfinite(value):
        raise LoraError(f"{source.path}: {key!r} is {value}, not a finite number")
    return value


def _floats(source: TensorSource, *keys: str) -> None:
    for key in keys:
        dtype = source.dtype(key)
        if not dtype.is_floating_point:
            raise LoraError(f"{source.path}: {key!r} is {str(dtype).removeprefix('torch.')}; "
                            f"LoRA tensors are floating point")
