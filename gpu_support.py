"""What this machine offers our own GPU kernels, decided in one place: whether Triton is
installed, whether a device has fp8 tensor cores, and a warning said once when a kernel falls
back. The checks are plain constants or device properties, so torch.compile traces them."""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import warnings

import torch

# decided at import: under torch.compile a lookup inside traced code would split the graph
TRITON = importlib.util.find_spec("triton") is not None

# How every Triton kernel of this package is built (launch keyword arguments), whatever the
# Triton release's defaults: a * b + c as one fused multiply-add, as the kernels were written and
# measured. Triton 3.9 warns that its default turns fusion off in 3.10 (PyTorch 2.16); built so,
# each product-sum of our kernels would round twice (other bits) and take two instructions (the
# fp8 attention kernel's loop: 637 instead of 505 a block of keys, offline on Triton 3.9). A
# kernel that must round like PyTorch's separate steps passes enable_fp_fusion=False itself
# (quant/kernels.py). TRITON_FORCE_DISABLE_FP_FUSION, set by a user, still rules.
KERNEL_OPTIONS = {"enable_fp_fusion": True}


def triton_kernels_usable(x: torch.Tensor) -> bool:
    """Our Triton kernels can run on x's device (an NVIDIA GPU, Triton installed)."""
    return x.is_cuda and torch.version.hip is None and TRITON


def fp8_unavailable(device: torch.device, subject: str) -> str | None:
    """Why `subject` (e.g. "fp8 matmul") cannot use fp8 e4m3fn tensor cores on `device`, or None
    when it can: NVIDIA GPUs of compute capability 8.9 or later (Ada, Hopper)."""
    if device.type != "cuda":
        return (f"{subject} needs a CUDA GPU (an NVIDIA GPU of compute capability 8.9 or "
                f"later); this runs on {device.type}")
    if torch.version.hip is not None:
        return f"{subject} needs an NVIDIA GPU (ROCm GPUs use e4m3fnuz)"
    props = torch.cuda.get_device_properties(device)
    if (props.major, props.minor) < (8, 9):
        return (f"{subject} needs compute capability 8.9 or later (Ada, Hopper); {props.name} "
                f"has {props.major}.{props.minor}")
    return None


def import_gluon_kernel(module: str, package: str):
    """The Gluon kernel module `module` (relative to `package`), or the reason it cannot be
    imported (a str): no Triton, or a Triton without the Gluon API it is written against."""
    if not TRITON:
        return "it needs Triton, which is not installed"
    try:
        return importlib.import_module(module, package)
    except Exception as exc:  # an older or newer Triton without this Gluon API
        return f"this Triton has no Gluon for Hopper ({type(exc).__name__}: {exc})"


def spill_problem(compiled, limit_words: int) -> str | None:
    """Why a kernel Triton has just built should not be what `auto` runs: each of its threads
    keeps more than `limit_words` 4-byte words in local memory (registers spilled there; Triton's
    CompiledKernel.n_spills), which some Triton releases do to a kernel that others build
    without; or None. `compiled`: what launching a Triton kernel returned."""
    words = getattr(compiled, "n_spills", None)
    if not isinstance(words, int) or words <= limit_words:
        return None
    return (f"Triton {triton_version()} builds it with {4 * words} bytes of local memory a "
            f"thread (spilled registers; the kernel is fast with at most {4 * limit_words})")


def triton_version() -> str:
    """The installed Triton's version (what our kernels are built with), without importing it;
    "not installed" without one."""
    try:
        return importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


_OPERATORS: dict[str, tuple] = {}  # qualified name -> (fn, fake, mutates): not yet registered


def kernel_operator(qualified_name: str, fn, fake, mutates: tuple[str, ...] = ()):
    """A callable for the kernel launcher `fn`: while torch.compile traces, the PyTorch operator
    `namespace::name` with `fake` (its output shapes), which keeps the kernel whole inside a
    compiled region; in eager runs `fn` itself, without the operator's dispatch (tens of
    microseconds a call). `mutates`: the arguments fn writes in place (the compiler then writes
    into the graph's own input there, no copy).

    The operator is registered only when something compiles (register_kernel_operators, which
    wan/compiled_blocks.py calls before torch.compile; or a trace that reaches the kernel
    first): registering imports torch's fake-tensor and compiler machinery, seconds of an eager
    run's start spent on nothing it uses. It is registered once per process, also when two
    copies of this package are imported (ComfyUI's custom_nodes copy and an installed one): the
    second copy gets the first one's."""
    _OPERATORS[qualified_name] = (fn, fake, mutates)

    def call(*args):
        if torch.compiler.is_compiling():
            return _registered(qualified_name)(*args)
        return fn(*args)
    return call


def register_kernel_operators() -> None:
    """Register the operator of every kernel imported so far (before torch.compile traces)."""
    for name in list(_OPERATORS):
        _registered(name)


def _registered(qualified_name: str):
    namespace, name = qualified_name.split("::")
    operator = getattr(getattr(torch.ops, namespace), name, None)
    if operator is None:
        fn, fake, mutates = _OPERATORS[qualified_name]
        operator = torch.library.custom_op(qualified_name, fn, mutates_args=mutates)
        operator.register_fake(fake)
    return operator


_WARNED: set[str] = set()


def warn_once(message: str, stacklevel: int = 2) -> None:
    """A RuntimeWarning the first time `message` comes up in this process. Silent while
    torch.compile traces (a warning would break the graph): the loaders warn at load time for
    that reason."""
    if torch.compiler.is_compiling() or message in _WARNED:
        return
    _WARNED.add(message)
    warnings.warn(message, RuntimeWarning, stacklevel=stacklevel + 1)
