"""The suite runs where users clone the project: a folder named `comfyui-wan-enhanced` (what
`git clone` gives and what goes into ComfyUI's custom_nodes/), under a path holding a dot.
pytest imports the root `__init__.py` there as a module of no package; every test used to error
at collection."""

import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def tracked_files() -> list[str]:
    done = subprocess.run(["git", "-C", str(ROOT), "ls-files"], capture_output=True, text=True)
    if done.returncode != 0:  # not a git checkout (an unpacked archive): the tree as it is
        return [str(p.relative_to(ROOT)) for p in ROOT.rglob("*")
                if p.is_file() and ".git" not in p.parts]
    return done.stdout.splitlines()


def test_the_suite_collects_and_runs_from_a_clone_named_as_users_have_it(tmp_path):
    clone = tmp_path / "custom.nodes" / "comfyui-wan-enhanced"
    for name in tracked_files():
        source = ROOT / name
        if source.is_file() and not name.startswith("tests/golden/"):
            target = clone / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
    collected = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--co",
         "tests/test_lora_files.py", "tests/test_import_graph.py"],
        cwd=clone, capture_output=True, text=True, timeout=300)
    assert collected.returncode == 0, collected.stdout[-3000:] + collected.stderr[-2000:]
    assert re.search(r"\d+ errors?\b", collected.stdout) is None, collected.stdout[-3000:]
    assert re.search(r"\d+ tests? collected", collected.stdout)
    ran = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         "tests/test_import_graph.py"], cwd=clone, capture_output=True, text=True, timeout=300)
    assert ran.returncode == 0, ran.stdout[-3000:] + ran.stderr[-2000:]
    assert " passed" in ran.stdout
