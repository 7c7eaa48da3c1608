"""Compile the fp8 attention kernel for a Hopper GPU (sm_90), or the portable one for Ada
(sm_89, --sm 89), without one, and report what the compiler made of it: registers,
local-memory spills, and how the tensor-core products are waited for.

    python bench/kernel_probe.py [--config 64 128 4 3 ...] [--hopper | --hopper-bf16]
                                 [--sass FILE] [--loops] [--sm 89|90]

Needs Triton (the ptxas and cuobjdump it is set to use), not a GPU. Per configuration (BLOCK_M
BLOCK_N num_warps num_stages) it prints the registers per thread, the local memory (stack) a thread
takes, the spill stores and loads in the
SASS, the number of wgmma instructions, and the pending count of every `wgmma.wait_group` in
the PTX: all zeros means every product is waited for right after it is issued, so within one
warp group the softmax never overlaps the tensor cores. --hopper probes the Hopper kernel
(wan/fp8_attention_hopper.py) and says whether ptxas serializes its products; --hopper-bf16
the same of the exact Hopper kernel (wan/bf16_attention_hopper.py). --loops prints, for each
innermost loop of the SASS of at least 200 instructions (the consumers' per-block loops), its
length and its instructions by opcode: what one block of keys costs a thread.
"""

from __future__ import annotations

import argparse
import collections
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from wan_enhanced.gpu_support import KERNEL_OPTIONS

POINTERS = {"q_ptr": "*i8", "k_ptr": "*i8", "vt_ptr": "*fp8e4nv", "qs_ptr": "*fp32",
            "ks_ptr": "*fp32", "vs_ptr": "*fp32", "o_ptr": "*bf16"}
DEFAULT_CONFIGS = ((64, 128, 4, 3), (128, 128, 8, 3), (64, 64, 4, 3), (128, 64, 8, 3))


def compile_portable(block_m: int, block_n: int, warps: int, stages: int, pv_fp8: bool = True,
                     capability: int = 90):
    """The portable kernel in one configuration, for sm_90 (or `capability`: 89 for Ada, whose
    products are mma.sync, not wgmma)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from wan_enhanced.wan.fp8_attention_kernels import attention_kernel

    fn = attention_kernel
    while not isinstance(fn, triton.runtime.jit.JITFunction):  # under the autotuner
        fn = fn.fn
    constants = {"D": 128, "KB": 128, "PV_FP8": pv_fp8, "BLOCK_M": block_m, "BLOCK_N": block_n}
    signature = {name: POINTERS.get(name, "constexpr" if name in constants else "i32")
                 for name in fn.arg_names}
    # as the launcher specializes them at Wan's shapes: pointers and the lengths and strides
    # that are multiples of 16 (all but H)
    aligned = [name for name in fn.arg_names if name not in constants and name != "H"]
    attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name in aligned}
    source = ASTSource(fn=fn, signature=signature, constexprs=constants, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", capability, 32),
                          options={"num_warps": warps, "num_stages": stages, **KERNEL_OPTIONS})


def _descriptor_type(dtype: str, block: tuple[int, int], bits: int = 8) -> str:
    return (f"tensordesc<{dtype}[{block[0]}, {block[1]}],NVMMASharedLayout(swizzle_byte_width=128, "
            f"element_bitwidth={bits}, rank=2, transposed=False, fp4_padded=False, cga_layout=[])>")


def _compile_gluon_for_sm90(module, fn, types: dict[str, str], unaligned: tuple[str, ...]):
    """A Hopper kernel of `module` (its HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, CONSUMER_REGS,
    BUILD_OPTIONS) with its launcher's settings: `types` for the descriptors and pointers, every
    other integer argument but `unaligned` a multiple of 16, as the launcher specializes them."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    constants = {"D": module.HEAD_DIM, "BLOCK_M": module.BLOCK_M, "BLOCK_N": module.BLOCK_N,
                 "STAGES": module.STAGES, "CONSUMER_REGS": module.CONSUMER_REGS, "num_warps": 4}
    if "GROUPS" in fn.arg_names:  # the fp8 kernel's consumer groups and where they store P
        constants["GROUPS"] = module.GROUPS
        constants["P_EARLY"] = module.P_EARLY
    signature = {name: types.get(name, "constexpr" if name in constants else "i32")
                 for name in fn.arg_names}
    aligned = [name for name in fn.arg_names if name not in constants
               and name not in unaligned and not name.endswith("_desc")]
    attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name in aligned}
    source = GluonASTSource(fn=fn, signature=signature, constexprs=constants, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32),
                          options={**module.BUILD_OPTIONS, **KERNEL_OPTIONS})


def compile_hopper_for_sm90():
    """The Hopper kernel (wan/fp8_attention_hopper.py) with its launcher's settings."""
    from wan_enhanced.wan import fp8_attention_hopper as hopper

    types = {"q_desc": _descriptor_type("i8", (hopper.BLOCK_M, hopper.HEAD_DIM)),
             "k_desc": _descriptor_type("i8", (hopper.BLOCK_N, hopper.HEAD_DIM)),
             "v_desc": _descriptor_type("fp8e4nv", (hopper.HEAD_DIM, hopper.BLOCK_N)),
             **{name: kind for name, kind in POINTERS.items() if name not in ("q_ptr", "k_ptr",
                                                                              "vt_ptr")}}
    return _compile_gluon_for_sm90(hopper, hopper.hopper_attention_kernel, types, ("H", ))


def compile_bf16_hopper_for_sm90():
    """The exact Hopper kernel (wan/bf16_attention_hopper.py) in bf16 with its launcher's
    settings."""
    from wan_enhanced.wan import bf16_attention_hopper as hopper

    types = {name: _descriptor_type("bf16", (rows, hopper.HEAD_DIM), 16)
             for name, rows in (("q_desc", hopper.BLOCK_M), ("k_desc", hopper.BLOCK_N),
                                ("v_desc", hopper.BLOCK_N))}
    types.update(o_ptr="*bf16", score_scale="fp32")
    return _compile_gluon_for_sm90(hopper, hopper.hopper_bf16_attention_kernel, types,
                                   ("H", "score_scale"))


def triton_ptxas() -> str:
    """The ptxas Triton compiles sm_90 with: its bundled one unless TRITON_PTXAS_PATH names
    another (TRITON_PTXAS_BLACKWELL_PATH from Triton 3.9 on, which builds sm_90 with its newer
    ptxas; torch's inductor sets the variable to the CUDA toolkit's ptxas that ships with torch,
    once it has compiled anything in the process). Triton writes its PTX for that ptxas's
    version, which an older ptxas refuses."""
    from triton.backends.nvidia.compiler import get_ptxas

    return get_ptxas(90).path


def triton_cuobjdump() -> str:
    """The cuobjdump Triton is set to use (TRITON_CUOBJDUMP_PATH, else its bundled one)."""
    from triton import knobs

    return knobs.nvidia.cuobjdump.path


def serialized(kernel) -> bool:
    """Whether ptxas serializes the kernel's tensor-core products (its C7514 advice)."""
    ptxas = triton_ptxas()
    with tempfile.TemporaryDirectory() as tmp:
        ptx = Path(tmp) / "kernel.ptx"
        ptx.write_text(kernel.asm["ptx"])
        advice = subprocess.run([ptxas, "--gpu-name", "sm_90a", str(ptx), "-o",
                                 str(Path(tmp) / "kernel.cubin")],
                                capture_output=True, text=True)
    if advice.returncode != 0:
        raise RuntimeError(f"kernel_probe: {ptxas} could not assemble the kernel's PTX "
                           f"(exit {advice.returncode}): {advice.stderr.strip()[-2000:]}")
    return "wgmma.mma_async instructions are serialized" in advice.stdout + advice.stderr


def report(kernel) -> tuple[dict, str]:
    cuobjdump = triton_cuobjdump()
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(kernel.asm["cubin"])
        cubin.flush()
        usage = subprocess.run([cuobjdump, "-res-usage", cubin.name],
                               capture_output=True, text=True, check=True).stdout
        sass = subprocess.run([cuobjdump, "-sass", cubin.name],
                              capture_output=True, text=True, check=True).stdout
    ptx = kernel.asm["ptx"]
    registers = re.search(r"REG:(\d+)", usage)
    stack = re.search(r"STACK:(\d+)", usage)
    return {"registers": int(registers.group(1)) if registers else None,
            "stack_bytes": int(stack.group(1)) if stack else None,
            "spill_stores": len(re.findall(r"\bSTL\b", sass)),
            "spill_loads": len(re.findall(r"\bLDL\b", sass)),
            "wgmma": len(re.findall(r"wgmma\.mma_async", ptx)),
            "wait_pending": [int(n) for n in re.findall(r"wgmma\.wait_group\.sync\.aligned (\d+)",
                                                         ptx)]}, sass


_SASS_LINE = re.compile(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_BRANCH_TARGET = re.compile(r"\bBRA\b.*?0x([0-9a-f]+)")


def sass_loops(sass: str, shortest: int = 200) -> list[dict]:
    """The innermost loops of a cuobjdump SASS listing: each backward branch closes one, from its
    target to itself, but those after the last EXIT (code out of line, such as an mbarrier
    wait's retry, jumping back). Per loop of at least `shortest` instructions: its first and
    last address, its length and its opcodes counted (predicates and modifiers dropped:
    `@!P0 MUFU.EX2` counts as MUFU), most frequent first; where its exponentials lie
    (`exponentials`: the first and last MUFU.EX2's position in the loop, or None) and where its
    waits and barriers are (`syncs`: position and instruction of every WARPGROUP, BAR and SYNCS
    instruction), e.g. whether a tensor-core product is waited for before the exponentials."""
    instructions = [(int(m.group(1), 16), m.group(2)) for m in map(_SASS_LINE.match,
                                                                  sass.splitlines()) if m]
    index = {address: i for i, (address, _) in enumerate(instructions)}
    exits = [address for address, text in instructions if text.split()[-1] == "EXIT"]
    last_exit = exits[-1] if exits else float("inf")
    loops = []
    for end, (address, text) in enumerate(instructions):
        target = _BRANCH_TARGET.search(text)
        if address > last_exit or target is None or int(target.group(1), 16) >= address:
            continue
        start = index.get(int(target.group(1), 16))
        if start is None or end - start + 1 < shortest:
            continue
        bodies = [re.sub(r"^@!?U?P\w+\s+", "", body) for _, body in instructions[start:end + 1]]
        opcodes = collections.Counter(body.split()[0].split(".")[0] for body in bodies)
        exps = [i for i, body in enumerate(bodies) if body.startswith("MUFU.EX2")]
        syncs = [(i, body) for i, body in enumerate(bodies)
                 if body.split()[0].split(".")[0] in ("WARPGROUP", "BAR", "SYNCS")]
        loops.append({"start": instructions[start][0], "end": address,
                      "instructions": end - start + 1, "opcodes": dict(opcodes.most_common()),
                      "exponentials": (exps[0], exps[-1]) if exps else None, "syncs": syncs})
    return [loop for loop in loops
            if not any(other is not loop and loop["start"] <= other["start"]
                       and other["end"] <= loop["end"] for other in loops)]


def print_loops(sass: str) -> None:
    for loop in sass_loops(sass):
        counts = ", ".join(f"{op} {n}" for op, n in loop["opcodes"].items())
        print(f"  loop {loop['start']:#x}-{loop['end']:#x}: {loop['instructions']} "
              f"instructions: {counts}")
        if loop["exponentials"]:
            print("    exponentials at {}-{}".format(*loop["exponentials"]))
        for position, body in loop["syncs"]:
            print(f"    {position:4d} {body}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", nargs=4, type=int, action="append",
                        metavar=("BLOCK_M", "BLOCK_N", "WARPS", "STAGES"))
    parser.add_argument("--sass", type=Path, help="write the first configuration's SASS here")
    parser.add_argument("--hopper", action="store_true",
                        help="the Hopper kernel (fp8_attention_hopper.py) instead")
    parser.add_argument("--hopper-bf16", action="store_true",
                        help="the exact Hopper kernel (bf16_attention_hopper.py) instead")
    parser.add_argument("--sm", type=int, default=90, choices=(89, 90),
                        help="the portable kernel's target: 90 (Hopper) or 89 (Ada)")
    parser.add_argument("--loops", action="store_true",
                        help="each long loop's instructions by opcode (per block of keys)")
    args = parser.parse_args(argv)
    try:
        import triton  # noqa: F401
    except ImportError:
        print("kernel_probe: needs Triton (pip install triton); no GPU is needed", file=sys.stderr)
        return 2
    if args.hopper or args.hopper_bf16:
        kernel = compile_hopper_for_sm90() if args.hopper else compile_bf16_hopper_for_sm90()
        facts, sass = report(kernel)
        facts["serialized"] = serialized(kernel)
        print(f"{'hopper' if args.hopper else 'bf16 hopper'} kernel: {facts}")
        if args.loops:
            print_loops(sass)
        if args.sass is not None:
            args.sass.write_text(sass)
        return 0
    for index, config in enumerate(args.config or DEFAULT_CONFIGS):
        facts, sass = report(compile_portable(*config, capability=args.sm))
        print(f"{'x'.join(map(str, config[:2]))} warps {config[2]} stages {config[3]}: {facts}")
        if args.loops:
            print_loops(sass)
        if index == 0 and args.sass is not None:
            args.sass.write_text(sass)
    return 0


if __name__ == "__main__":
    sys.exit(main())
