"""The first code a worker process runs: it imports this package, then runs the worker loop.

A spawned process starts from a fresh interpreter and imports the function it runs by module
name. Inside ComfyUI this package is registered under its folder's path, which no fresh
interpreter can import, so the process target lives in this module of a unique name, in a folder
of its own that the group puts on the path (nothing else becomes importable). It imports the
package by name when that name is importable (pip installs, tests), else from its folder under a
private name, and hands over to distributed/worker.py.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path

PRIVATE_NAME = "wan_enhanced_worker_package"


def load_package(name: str, root: str):
    root_init = (Path(root) / "__init__.py").resolve()
    if name.isidentifier() or all(part.isidentifier() for part in name.split(".")):
        try:
            package = importlib.import_module(name)
            if Path(package.__file__).resolve() == root_init:
                return package
        except ImportError:
            pass
    if PRIVATE_NAME in sys.modules:
        return sys.modules[PRIVATE_NAME]
    spec = importlib.util.spec_from_file_location(PRIVATE_NAME, root_init,
                                                  submodule_search_locations=[str(root)])
    package = importlib.util.module_from_spec(spec)
    sys.modules[PRIVATE_NAME] = package
    spec.loader.exec_module(package)
    return package


def main(rank: int, package_name: str, package_root: str, *args) -> None:
    package = load_package(package_name, package_root)
    worker = importlib.import_module(f"{package.__name__}.distributed.worker")
    worker.serve(rank, *args, driver_package=package_name)
