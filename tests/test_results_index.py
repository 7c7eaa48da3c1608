"""bench/results/README.md lists every results folder, and the folders the READMEs name exist."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
NAMED = re.compile(r"bench/results/([0-9]{4}-[0-9]{2}-[0-9]{2}-[A-Za-z0-9_.-]+?)/")


def _folders() -> set[str]:
    return {p.name for p in RESULTS.iterdir() if p.is_dir()}


def test_the_index_lists_every_results_folder_and_nothing_else():
    index = (RESULTS / "README.md").read_text()
    listed = set(re.findall(r"^\| \[`([^`]+)`\]\(\1/\) \| .+ \|$", index, flags=re.M))
    assert listed == _folders(), (f"not in bench/results/README.md: {_folders() - listed}; "
                                  f"listed but missing: {listed - _folders()}")


def test_every_results_folder_the_readme_names_exists():
    named = set(NAMED.findall((ROOT / "README.md").read_text()))
    assert named, "the README names no results folder"
    assert named <= _folders(), f"named in README.md but not in bench/results/: {named - _folders()}"
