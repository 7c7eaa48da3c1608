"""The Triton-release facts the Hopper kernels are built with (wan/gluon_hopper.py): which name
loads a block by TMA, and where the fp8 kernel stores P. Checked against stand-in Triton
modules, so it runs without Triton; the module is loaded under a name of its own and never
enters sys.modules as the package's."""

import importlib.metadata
import importlib.util
import sys
import types
from pathlib import Path

import pytest

SOURCE = Path(__file__).resolve().parents[1] / "wan" / "gluon_hopper.py"


def _stand_in_triton(monkeypatch, version: str, tma: types.SimpleNamespace):
    names = ["triton", "triton.experimental", "triton.experimental.gluon",
             "triton.experimental.gluon.language", "triton.experimental.gluon.language.nvidia",
             "triton.experimental.gluon.language.nvidia.hopper"]
    for name in names:
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    sys.modules["triton"].__version__ = version
    sys.modules[names[-1]].tma = tma


def _load(monkeypatch, version: str, tma: types.SimpleNamespace):
    _stand_in_triton(monkeypatch, version, tma)
    spec = importlib.util.spec_from_file_location("_gluon_hopper_under_test", SOURCE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _old_name(*args):
    return "old"


def _new_name(*args):
    return "new"


@pytest.mark.parametrize("version, tma, load, early, ptxas", [
    ("3.6.0", types.SimpleNamespace(async_copy_global_to_shared=_old_name), _old_name, False,
     None),
    ("3.7.1", types.SimpleNamespace(async_copy_global_to_shared=_old_name), _old_name, False,
     None),
    ("3.8.0", types.SimpleNamespace(async_copy_global_to_shared=_old_name,
                                    async_load=_new_name), _new_name, True, "-O1"),
    ("3.9.0+git1a2b3c", types.SimpleNamespace(async_copy_global_to_shared=_old_name,
                                              async_load=_new_name), _new_name, True, "-O1"),
])
def test_each_triton_release_gets_its_load_and_its_build_of_the_fp8_kernel(
        monkeypatch, version, tma, load, early, ptxas):
    module = _load(monkeypatch, version, tma)
    assert module.tma_load is load
    assert module.STORE_P_EARLY is early
    assert module.FP8_PTXAS_OPTIONS == ptxas


def test_release_numbers_are_read_from_version_strings(monkeypatch):
    module = _load(monkeypatch, "3.10.2+gitabc", types.SimpleNamespace(async_load=_new_name))
    assert module.STORE_P_EARLY is True  # 3.10 comes after 3.8, not before it as a string
    assert module.release("3.9.0") == (3, 9)
    assert module.release("3.10.2+gitabc") == (3, 10)
    assert module.release("dev") == (0, 0)


def test_results_and_warnings_name_the_installed_triton(monkeypatch):
    from wan_enhanced import gpu_support

    def installed(name):
        assert name == "triton"
        return "3.9.0"

    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", installed)
    assert gpu_support.triton_version() == "3.9.0"
    assert "Triton 3.9.0 builds it with 296 bytes" in gpu_support.spill_problem(
        types.SimpleNamespace(n_spills=74), 24)
    assert gpu_support.spill_problem(types.SimpleNamespace(n_spills=24), 24) is None
    assert gpu_support.spill_problem(object(), 24) is None  # a launcher that says nothing
    monkeypatch.setattr(importlib.metadata, "version", missing)
    assert gpu_support.triton_version() == "not installed"
