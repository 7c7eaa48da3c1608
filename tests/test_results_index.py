"""bench/results/README.md lists every results folder; the README and docs/ name exactly those
folders (a folder is kept because a figure there rests on it; experiments are index lines)."""

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


def _named() -> set[str]:
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    return {name for page in pages if page.is_file()
            for name in NAMED.findall(page.read_text())}


def test_the_readme_and_docs_name_every_results_folder_and_only_those():
    named = _named()
    assert named, "the README and docs/ name no results folder"
    assert named <= _folders(), f"named but not in bench/results/: {named - _folders()}"
    assert _folders() <= named, (f"in bench/results/ but no figure in the README or docs/ rests "
                                 f"on it: {_folders() - named}")
