"""The hostile-workflow corpus (hostile_corpus.py) through our command line: every case is refused
in validation (exit code 2) with a message naming its node and input, before any model loads,
and leaves no file behind (nothing in the output folder, the models folder and the file the
paths aim at unchanged). The same corpus goes through a real ComfyUI in test_comfyui_host.py."""

from __future__ import annotations

import json

import pytest

import hostile_corpus as corpus
from wan_enhanced import host
from wan_enhanced.pipeline import loading
from wan_enhanced.runner import cli
from wan_enhanced.runner.workflow import WorkflowError, validate
from wan_enhanced.nodes import NODE_CLASS_MAPPINGS as NODES


@pytest.fixture(scope="module")
def setting(tmp_path_factory):
    return corpus.make_setting(tmp_path_factory.mktemp("hostile"))


CASES = corpus.cases(corpus.placeholder_setting())


def _case(name: str, setting) -> corpus.Case:
    return next(c for c in corpus.cases(setting) if c.name == name)


@pytest.fixture
def guarded(setting, tmp_path, monkeypatch):
    """The output folder of one case, with every model load recorded."""
    loads = []
    for name in ("load_model", "load_vae_handle", "load_text_encoder_handle",
                 "load_clip_vision_handle"):
        monkeypatch.setattr(loading, name, lambda *a, _n=name, **k: loads.append(_n))
    yield tmp_path / "out", loads
    host.set_headless_folders(models="models", output="output")


def test_the_base_workflow_is_valid(setting, tmp_path):
    host.set_headless_folders(models=setting.models, output=tmp_path / "out")
    try:
        validate(corpus.base_workflow(), NODES)
    finally:
        host.set_headless_folders(models="models", output="output")


def test_the_corpus_covers_every_path_and_number_input():
    names = {(c.node, c.input) for c in CASES}
    assert {(n, i) for n, i in corpus.PATH_INPUTS.items()} <= names
    numeric = {(n, name) for n in ("5", "6", "7", "8")
               for name, spec in {**NODES[corpus.base_workflow()[n]["class_type"]]
                                  .INPUT_TYPES()["required"],
                                  **NODES[corpus.base_workflow()[n]["class_type"]]
                                  .INPUT_TYPES().get("optional", {})}.items()
               if spec[0] in ("INT", "FLOAT")}
    assert len(numeric) == 23 and numeric <= names


@pytest.mark.parametrize("name", [c.name for c in CASES])
def test_hostile_case_is_refused_before_anything_runs(name, setting, guarded, tmp_path, capsys):
    case = _case(name, setting)
    out, loads = guarded
    if case.headless_allowed:  # our command line takes an absolute model path as given
        host.set_headless_folders(models=setting.models, output=out)
        validate(corpus.apply(case), NODES)
        return
    before = (corpus.tree(setting.models), setting.victim.read_text())
    path = tmp_path / "workflow.json"
    path.write_text(json.dumps(corpus.apply(case)))
    code = cli.main(["run", str(path), "--models", str(setting.models), "--out", str(out),
                     "--quiet"])
    err = capsys.readouterr().err
    assert code == 2, err
    cls = corpus.base_workflow()[case.node]["class_type"]
    assert f'node {case.node} ({cls}' in err and f'input "{case.input}"' in err, err
    assert loads == []
    assert not out.exists()
    assert (corpus.tree(setting.models), setting.victim.read_text()) == before
    assert "this must never run" not in err


@pytest.mark.parametrize("name", [c.name for c in CASES if not c.headless_allowed])
def test_validation_locates_each_problem(name, setting, tmp_path):
    """The runner's validation reports the case at its node and input (the issue objects a
    caller gets, not just text)."""
    case = _case(name, setting)
    host.set_headless_folders(models=setting.models, output=tmp_path / "out")
    try:
        with pytest.raises(WorkflowError) as caught:
            validate(corpus.apply(case), NODES)
    finally:
        host.set_headless_folders(models="models", output="output")
    assert any(issue.node_id == case.node and issue.input_name == case.input
               for issue in caught.value.errors), caught.value
