"""What ptxas makes of ex2.approx.f16x2 for sm_90 (no GPU needed): a Triton kernel that packs two
float32 exponents into half2 and takes both exponentials in one PTX instruction; prints the
SASS lines of the conversion and the special-function unit.

    python probe.py   (Triton 3.6; its bundled ptxas and cuobjdump)
"""
import subprocess
import tempfile
from pathlib import Path

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource


@triton.jit
def paired_exp2(x_ptr, o_ptr):
    offs = tl.arange(0, 1024)
    x = tl.load(x_ptr + offs)
    y = tl.inline_asm_elementwise(
        "{ .reg .b32 h; cvt.rn.f16x2.f32 h, $2, $1; ex2.approx.f16x2 $0, h; }",
        "=r,r,r", [x], dtype=tl.float16, is_pure=True, pack=2)
    tl.store(o_ptr + offs, y)


source = ASTSource(fn=paired_exp2, signature={"x_ptr": "*fp32", "o_ptr": "*fp16"}, constexprs={})
compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
cuobjdump = Path(triton.__file__).parent / "backends/nvidia/bin/cuobjdump"
with tempfile.TemporaryDirectory() as tmp:
    cubin = Path(tmp) / "k.cubin"
    cubin.write_bytes(compiled.asm["cubin"])
    sass = subprocess.run([str(cuobjdump), "-sass", str(cubin)], capture_output=True, text=True,
                          check=True).stdout
lines = [line.strip() for line in sass.splitlines() if "MUFU" in line or "F2FP" in line]
print("\n".join(lines))
print(f"ex2.approx.f16x2 instructions in the PTX: {compiled.asm['ptx'].count('ex2.approx.f16x2')}, "
      f"MUFU.EX2 in the SASS: {sum('MUFU.EX2' in line for line in lines)}")
