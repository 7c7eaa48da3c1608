"""The in-process runner: validation, execution, overrides, interrupts, memory release, sweeps and
the `wan-enhanced run` command, all with small fake node classes."""

from __future__ import annotations

import gc
import json
import os
import signal
import threading
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

import wan_enhanced
from wan_enhanced import host
from wan_enhanced.nodes.common import ANY
from wan_enhanced.runner import cli
from wan_enhanced.runner.executor import RunError, RunInterrupted, execute, run_workflow
from wan_enhanced.runner.overrides import OverrideError, apply_overrides
from wan_enhanced.runner.sweep import (ResultsLog, SweepError, expand_sweep, load_sweep,
                                       result_record)
from wan_enhanced.runner.workflow import WorkflowError, load_workflow, validate

@dataclass
class Recorder:
    """What the fake nodes saw in one test."""
    calls: list[str] = field(default_factory=list)  # class names in the order the nodes ran
    made: list[weakref.ref] = field(default_factory=list)  # every tensor the nodes created
    seen_kwargs: list[dict] = field(default_factory=list)  # Scale's inputs


class FakeNode:
    record: Recorder  # a fresh one for every test (the `record` fixture)


# -- fake nodes ------------------------------------------------------------------------------

class MakeTensor(FakeNode):
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"size": ("INT", {"default": 4, "min": 1, "max": 64})}}

    RETURN_TYPES = ("TENSOR",)
    FUNCTION = "make"

    def make(self, size):
        self.record.calls.append("MakeTensor")
        tensor = torch.ones(size)
        self.record.made.append(weakref.ref(tensor))
        return (tensor,)


class Scale(FakeNode):
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"tensor": ("TENSOR",),
                             "factor": ("FLOAT", {"default": 1.0, "min": 0.0, "max": 10.0})},
                "optional": {"offset": ("FLOAT", {"default": 0.0})}}

    RETURN_TYPES = ("TENSOR",)
    FUNCTION = "scale"

    def scale(self, tensor, factor, **optional):
        self.record.calls.append("Scale")
        self.record.seen_kwargs.append({"factor": factor, **optional})
        offset = optional.get("offset", 0.0)
        result = tensor * factor + offset
        self.record.made.append(weakref.ref(result))
        return (result,)


class SumTensor(FakeNode):
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"tensor": ("TENSOR",)}}

    RETURN_TYPES = ("FLOAT",)
    FUNCTION = "total"

    def total(self, tensor):
        self.record.calls.append("SumTensor")
        return (float(tensor.sum()),)


class AssertFreed(FakeNode):
    """Runs after the tensors' last readers: they must be gone already."""

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"value": ("FLOAT",)}}

    RETURN_TYPES = ("FLOAT",)
    FUNCTION = "check"

    def check(self, value):
        gc.collect()
        alive = [r for r in self.record.made if r() is not None]
        return ({"ui": {"alive": [len(alive)]}, "result": (value,)})


class AddInts(FakeNode):
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"a": ("INT", {"default": 0, "min": 0, "max": 100}),
                             "b": ("INT", {"default": 0, "min": 0, "max": 100})}}

    RETURN_TYPES = ("INT",)
    RETURN_NAMES = ("sum",)
    FUNCTION = "add"

    def add(self, a, b):
        self.record.calls.append("AddInts")
        return (a + b,)


class TextEncode(FakeNode):
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"positive": ("STRING", {"multiline": True}),
                             "negative": ("STRING", {"default": ""})}}

    RETURN_TYPES = ("CONDITIONING", "CONDITIONING")
    FUNCTION = "encode"

    def encode(self, positive, negative):
        self.record.calls.append("TextEncode")
        return ([positive], [negative])


class Sampler(FakeNode):
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"positive": ("CONDITIONING",),
                             "seed": ("INT", {"default": 0, "min": 0}),
                             "steps": ("INT", {"default": 10, "min": 1, "max": 100}),
                             "mode": (["fast", "slow"],),
                             "flag": ("BOOLEAN", {"default": False})}}

    RETURN_TYPES = ("LATENT,TENSOR",)
    FUNCTION = "sample"

    def sample(self, positive, seed, steps, mode, flag):
        self.record.calls.append("Sampler")
        return ({"prompt": positive[0], "seed": seed, "steps": steps, "mode": mode,
                 "flag": flag},)


class SaveValue(FakeNode):
    """An output node that writes a file into the output folder."""

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"value": (ANY,),
                             "filename_prefix": ("STRING", {"default": "out"})}}

    RETURN_TYPES = ()
    FUNCTION = "save"
    OUTPUT_NODE = True

    def save(self, value, filename_prefix):
        self.record.calls.append("SaveValue")
        folder = host.output_directory()
        folder.mkdir(parents=True, exist_ok=True)
        name = f"{filename_prefix}.json"
        if isinstance(value, torch.Tensor):
            value = value.tolist()
        (folder / name).write_text(json.dumps(value))
        return {"ui": {"files": [{"filename": name, "subfolder": "", "type": "output"}],
                       "text": [json.dumps(value)]}}


class Fails(FakeNode):
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"tensor": ("TENSOR",)}}

    RETURN_TYPES = ("TENSOR",)
    FUNCTION = "explode"

    def explode(self, tensor):
        self.record.calls.append("Fails")
        local = tensor * 2  # a tensor in the failing frame: must be freed too
        self.record.made.append(weakref.ref(local))
        raise RuntimeError("boom")


class Slow(FakeNode):
    """Reports progress and checks for interrupts each step, like the sampler does."""

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"tensor": ("TENSOR",), "steps": ("INT", {"default": 3})}}

    RETURN_TYPES = ("TENSOR",)
    FUNCTION = "work"
    STARTED = threading.Event()

    def work(self, tensor, steps):
        self.record.calls.append("Slow")
        progress = host.Progress(steps, "Slow node")
        for step in range(steps):
            Slow.STARTED.set()
            host.check_interrupt()
            threading.Event().wait(0.01)
            progress.update_to(step + 1)
        return (tensor,)


class Stopper(FakeNode):
    """Asks for an interrupt, as a signal handler would, and returns normally."""

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"tensor": ("TENSOR",)}}

    RETURN_TYPES = ("TENSOR",)
    FUNCTION = "stop"

    def stop(self, tensor):
        self.record.calls.append("Stopper")
        host.request_interrupt()
        return (tensor,)


class PressCtrlC(FakeNode):
    """Presses Ctrl-C (a SIGINT to this process, as the terminal sends it), then goes on unless
    asked to stop."""

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"tensor": ("TENSOR",)}}

    RETURN_TYPES = ("TENSOR",)
    FUNCTION = "press"
    SIGNAL = signal.SIGINT

    def press(self, tensor):
        self.record.calls.append(type(self).__name__)
        os.kill(os.getpid(), self.SIGNAL)
        threading.Event().wait(0.2)  # the signal's handlers, if any, run meanwhile
        host.check_interrupt()
        return (tensor,)


class Kill(PressCtrlC):
    """`kill` from another shell (a SIGTERM to this process), then goes on unless asked to
    stop."""

    SIGNAL = signal.SIGTERM


class FileChoice(FakeNode):
    """A combo whose value VALIDATE_INPUTS checks instead (headless jobs name any file)."""

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"path": (["a.txt"],), "count": ("INT", {"min": 1, "max": 2})}}

    RETURN_TYPES = ("STRING",)
    FUNCTION = "pick"

    @classmethod
    def VALIDATE_INPUTS(cls, path):
        return True if path.endswith(".txt") else f"{path!r} is not a .txt file"

    def pick(self, path, count):
        return (path * count,)


class WhoAmI(FakeNode):
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {}, "hidden": {"uid": "UNIQUE_ID", "prompt": "PROMPT"}}

    RETURN_TYPES = ()
    FUNCTION = "who"
    OUTPUT_NODE = True

    def who(self, uid, prompt):
        return {"ui": {"uid": [uid], "nodes": [sorted(prompt)]}}


REGISTRY = {cls.__name__: cls for cls in (MakeTensor, Scale, SumTensor, AssertFreed, AddInts,
                                           TextEncode, Sampler, SaveValue, Fails, Slow, Stopper,
                                           PressCtrlC, Kill, FileChoice, WhoAmI)}


@pytest.fixture(autouse=True)
def record(tmp_path):
    """A fresh Recorder for this test's fake nodes (returned for the test to read)."""
    FakeNode.record = Recorder()
    host.clear_interrupt()
    host.set_headless_folders(output=tmp_path / "out")
    yield FakeNode.record
    host.clear_interrupt()
    host.set_headless_folders(output="output")


def node(class_type, title=None, **inputs):
    entry = {"class_type": class_type, "inputs": inputs}
    if title:
        entry["_meta"] = {"title": title}
    return entry


def tensor_chain(last="SaveValue"):
    """MakeTensor -> Scale -> SumTensor -> SaveValue, plus an unconnected AddInts."""
    return {
        "1": node("MakeTensor", size=3),
        "2": node("Scale", "Scaler", tensor=["1", 0], factor=2.0),
        "3": node("SumTensor", tensor=["2", 0]),
        "4": node(last, value=["3", 0], filename_prefix="total"),
        "5": node("AddInts", a=1, b=2),
    }


def messages(excinfo) -> list[str]:
    return [str(issue) for issue in excinfo.value.errors]


# -- loading -----------------------------------------------------------------------------------

def test_ui_format_file_is_refused_with_how_to_export(tmp_path):
    path = tmp_path / "ui.json"
    path.write_text(json.dumps({"last_node_id": 2, "nodes": [{"id": 1}], "links": []}))
    with pytest.raises(WorkflowError) as excinfo:
        load_workflow(path)
    text = str(excinfo.value)
    assert str(path) in text and "UI-format" in text and "File > Export (API)" in text


def test_bad_json_and_missing_file_name_the_file(tmp_path):
    path = tmp_path / "broken.json"
    path.write_text("{\"1\": ")
    with pytest.raises(WorkflowError, match="(?s)broken.json is invalid .*not valid JSON"):
        load_workflow(path)
    with pytest.raises(WorkflowError, match="cannot read the file"):
        load_workflow(tmp_path / "absent.json")


def test_post_prompt_body_is_accepted(tmp_path):
    path = tmp_path / "body.json"
    path.write_text(json.dumps({"prompt": tensor_chain(), "client_id": "x"}))
    assert set(load_workflow(path)) == {"1", "2", "3", "4", "5"}


# -- validation --------------------------------------------------------------------------------

def test_validation_reports_every_error_with_node_input_and_expectation():
    workflow = {
        "1": node("MakeTensr", size=3),
        "2": node("Scale", "Scaler", tensor=["99", 0], factor="much"),
        "3": node("Sampler", positive=["4", 2], seed=-1, steps=500, mode="medium",
                  flag="yes"),
        "4": node("TextEncode", positive="a cat", negative=None),
        "5": node("AddInts", a=2.5, b=[7]),
        "6": node("SaveValue", value=["3", 0], filename_prefix=["5", 0]),
        "7": node("SaveValue", value=["2", 0]),
        "8": node("Scale", tensor=5, factor=1, offset=["4", 0]),
        "9": node("SaveValue", value=["8", 0], filename_prefix="x", extra=1),
        "10": {"inputs": {}},
    }
    with pytest.raises(WorkflowError) as excinfo:
        validate(workflow, REGISTRY, source="wf.json")
    assert messages(excinfo) == [
        'node 1 (MakeTensr): unknown node type "MakeTensr"; did you mean MakeTensor?',
        'node 10: has no "class_type" (every node needs the name of its node class)',
        'node 5 (AddInts), input "b": bad link [7]: expected [node_id, output_index]',
        'node 2 (Scale "Scaler"), input "tensor": linked to node 99, which is not in the workflow',
        'node 2 (Scale "Scaler"), input "factor": expected a number (FLOAT), got "much"',
        'node 3 (Sampler), input "positive": linked to output 2 of node 4 (TextEncode), which '
        'has only 2 outputs (CONDITIONING, CONDITIONING)',
        'node 3 (Sampler), input "seed": value -1 is smaller than the minimum 0',
        'node 3 (Sampler), input "steps": value 500 is bigger than the maximum 100',
        'node 3 (Sampler), input "mode": "medium" is not one of the choices: ["fast", "slow"]',
        'node 3 (Sampler), input "flag": expected true or false (BOOLEAN), got "yes"',
        'node 4 (TextEncode), input "negative": expected text (STRING), got null',
        'node 5 (AddInts), input "a": expected an integer (INT), got 2.5',
        'node 6 (SaveValue), input "filename_prefix": linked to output 0 of node 5 (AddInts), '
        'which is INT; expected STRING',
        'node 7 (SaveValue), input "filename_prefix": required input is missing '
        '(expected text (STRING))',
        'node 8 (Scale), input "tensor": expected a link to an output of type TENSOR, got the '
        'constant 5',
        'node 8 (Scale), input "offset": linked to output 0 of node 4 (TextEncode), which is '
        'CONDITIONING; expected FLOAT',
    ]
    assert str(excinfo.value).startswith("workflow wf.json is invalid (16 errors):\n  - node 1")


def test_unknown_input_is_a_warning_and_is_not_passed(record):
    workflow = tensor_chain()
    workflow["2"]["inputs"]["strength"] = 3
    validated = validate(workflow, REGISTRY)
    assert [str(w) for w in validated.warnings] == [
        'node 2 (Scale "Scaler"), input "strength": not an input of this node, ignored '
        '(its inputs: tensor, factor, offset)']
    execute(validated, REGISTRY)
    assert record.seen_kwargs == [{"factor": 2.0}]


def test_only_needed_nodes_are_checked_but_every_class_must_exist():
    workflow = tensor_chain()
    workflow["5"]["inputs"]["a"] = "not a number"  # node 5 leads to no output: never runs
    validate(workflow, REGISTRY)
    workflow["6"] = node("Nope")
    with pytest.raises(WorkflowError) as excinfo:
        validate(workflow, REGISTRY)
    assert messages(excinfo) == ['node 6 (Nope): unknown node type "Nope"; is the node pack '
                                 'that provides it installed?']


def test_no_output_node():
    with pytest.raises(WorkflowError) as excinfo:
        validate({"1": node("AddInts", a=1, b=2)}, REGISTRY)
    assert messages(excinfo) == ["the workflow has no output node (a node with OUTPUT_NODE = "
                                 "True, such as a save node), so nothing would run"]


def test_cycle_is_reported_with_its_nodes():
    workflow = {"1": node("AddInts", a=["2", 0], b=1), "2": node("AddInts", a=["1", 0], b=1),
                "3": node("SaveValue", value=["2", 0], filename_prefix="x")}
    with pytest.raises(WorkflowError) as excinfo:
        validate(workflow, REGISTRY)
    assert messages(excinfo) == ["node 2 (AddInts): dependency cycle: 2 (AddInts) -> "
                                 "1 (AddInts) -> 2 (AddInts)"]


def test_constants_are_converted_and_types_match_like_comfyui():
    workflow = {
        "1": node("TextEncode", positive=42, negative="n"),
        "2": node("Sampler", positive=["1", 0], seed="7", steps=12.0, mode="fast",
                  flag="False"),
        # "LATENT,TENSOR" fits TENSOR; the any-type takes anything
        "3": node("Scale", tensor=["2", 0], factor=3),
        "4": node("SaveValue", value=["3", 0], filename_prefix={"__value__": "p"}),
    }
    validated = validate(workflow, REGISTRY)
    assert validated.nodes["1"]["inputs"]["positive"] == "42"
    sampler = validated.nodes["2"]["inputs"]
    assert (sampler["seed"], sampler["steps"], sampler["flag"]) == (7, 12, False)
    assert validated.nodes["3"]["inputs"]["factor"] == 3.0
    assert validated.nodes["4"]["inputs"]["filename_prefix"] == "p"
    assert workflow["2"]["inputs"]["seed"] == "7"  # the caller's workflow is left as it was


class PlainStar:
    """A node written with a plain "*" string, as ComfyUI's /prompt sees it: no wildcard up to
    ComfyUI 0.7, any type from 0.8."""

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"value": ("*",)}}

    RETURN_TYPES = ("*",)
    FUNCTION = "passthrough"

    def passthrough(self, value):
        return (value,)


class Switch:
    """A V3 node with MatchType ends (ComfyUI's ComfySwitchNode) and a V3 combo input."""

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"on_true": ("COMFY_MATCHTYPE_V3",),
                             "mode": ("COMBO", {"options": ["a", "b"]})}}

    RETURN_TYPES = ("COMFY_MATCHTYPE_V3",)
    FUNCTION = "switch"


class Options:
    """A node whose output is a list of options (custom nodes do this for combos)."""

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {}}

    RETURN_TYPES = (["a", "b"],)
    FUNCTION = "options"


def test_a_plain_star_is_no_wildcard_before_comfyui_0_8_and_the_any_type_fits_both_ways():
    """ComfyUI 0.3.64's validate_node_input: '*' output into TENSOR and TENSOR into '*' are
    refused (return_type_mismatch); the any-type str (nodes/common.py) fits on either side.
    From 0.8.0 a plain '*' fits anything, alone or among alternatives."""
    from wan_enhanced.runner.graph_types import (CURRENT_LINKS, LEGACY_LINKS, NodeRegistry,
                                                 link_rule_for)
    from wan_enhanced.runner.workflow import types_compatible

    classes = {**REGISTRY, "PlainStar": PlainStar}
    graph = {"1": node("MakeTensor", size=2), "2": node("PlainStar", value=["1", 0]),
             "3": node("Scale", tensor=["2", 0], factor=2),
             "4": node("SaveValue", value=["3", 0], filename_prefix="x")}
    with pytest.raises(WorkflowError) as excinfo:
        validate(graph, NodeRegistry(classes, link_rule_for("0.3.64")))
    assert messages(excinfo) == [
        'node 2 (PlainStar), input "value": linked to output 0 of node 1 (MakeTensor), which '
        'is TENSOR; expected *',
        'node 3 (Scale), input "tensor": linked to output 0 of node 2 (PlainStar), which is *; '
        'expected TENSOR']
    for registry in (NodeRegistry(classes, link_rule_for("0.30.0")), classes):
        assert validate(graph, registry).order  # today's rule, also for our own nodes
    for rule in (LEGACY_LINKS, CURRENT_LINKS):
        assert types_compatible(ANY, "WANMODEL", rule) and types_compatible("WANMODEL", ANY, rule)
        assert types_compatible(ANY, ["a", "b"], rule)
        assert types_compatible("LATENT,TENSOR", "TENSOR", rule)
        assert not types_compatible("A,B", "C", rule)
    assert not types_compatible("*", "WANMODEL", LEGACY_LINKS)
    assert types_compatible("*", "WANMODEL", CURRENT_LINKS)
    assert types_compatible("WANMODEL", "LATENT,*", CURRENT_LINKS)


def test_matchtype_ends_and_options_into_a_combo_follow_the_release():
    """MatchType ends fit anything from ComfyUI 0.4.0 (our latent through its switch node); a
    list of options into a V3 COMBO input from 0.8.0; a V3 combo's link is checked against
    "COMBO" itself, not its options."""
    from wan_enhanced.runner.graph_types import NodeRegistry, link_rule_for

    classes = {**REGISTRY, "Switch": Switch, "Options": Options}
    graph = {"1": node("MakeTensor", size=2), "2": node("Options"),
             "3": node("Switch", on_true=["1", 0], mode=["2", 0]),
             "4": node("Scale", tensor=["3", 0], factor=2),
             "5": node("SaveValue", value=["4", 0], filename_prefix="x")}
    for version, refused in (("0.3.64", ["on_true", "mode", "tensor"]), ("0.4.0", ["mode"]),
                             ("0.7.0", ["mode"]), ("v0.8.0", []), ("0.30.0", []),
                             (None, [])):
        registry = NodeRegistry(classes, link_rule_for(version))
        if not refused:
            assert validate(graph, registry).order, version
            continue
        with pytest.raises(WorkflowError) as excinfo:
            validate(graph, registry)
        assert [e.input_name for e in excinfo.value.errors] == refused, version


def test_versions_are_read_as_numbers():
    from wan_enhanced.host import version_numbers

    assert version_numbers("0.3.64") == (0, 3, 64) and version_numbers("v0.30.0") == (0, 30, 0)
    assert version_numbers("0.10.1") == (0, 10, 1) and version_numbers("0.10.x") is None
    assert version_numbers("unknown") is None and version_numbers(None) is None
    assert version_numbers("0.30.0") > version_numbers("0.8.0") > version_numbers("0.3.64")


def test_validate_inputs_replaces_the_builtin_checks_for_its_inputs():
    def workflow(path, count):
        return {"1": node("FileChoice", path=path, count=count),
                "2": node("SaveValue", value=["1", 0], filename_prefix="x")}
    validate(workflow("other.txt", 1), REGISTRY)  # not in the combo: VALIDATE_INPUTS decides
    with pytest.raises(WorkflowError) as excinfo:
        validate(workflow("b.png", 1), REGISTRY)
    assert messages(excinfo) == ["node 1 (FileChoice): VALIDATE_INPUTS rejected the inputs: "
                                 "'b.png' is not a .txt file"]
    with pytest.raises(WorkflowError) as excinfo:
        validate(workflow("b.txt", 3), REGISTRY)  # count is not a parameter: still checked
    assert messages(excinfo) == ['node 1 (FileChoice), input "count": value 3 is bigger than '
                                 'the maximum 2']


# -- execution ---------------------------------------------------------------------------------

def test_runs_needed_nodes_in_dependency_order_and_collects_ui(tmp_path, record):
    events = []
    result = run_workflow(tensor_chain(), REGISTRY, on_event=events.append)
    assert record.calls == ["MakeTensor", "Scale", "SumTensor", "SaveValue"]  # not AddInts
    assert result.outputs == {"4": {"files": [{"filename": "total.json", "subfolder": "",
                                               "type": "output"}], "text": ["6.0"]}}
    assert result.files == [str(tmp_path / "out" / "total.json")]
    assert json.loads((tmp_path / "out" / "total.json").read_text()) == 6.0
    assert set(result.node_seconds) == {"1", "2", "3", "4"}
    assert result.seconds >= sum(result.node_seconds.values())
    assert result.peak.rss is not None and result.peak.rss > 0
    assert [(e.kind, e.node_id, e.index, e.count) for e in events] == [
        ("start", "1", 1, 4), ("finish", "1", 1, 4), ("start", "2", 1 + 1, 4),
        ("finish", "2", 2, 4), ("start", "3", 3, 4), ("finish", "3", 3, 4),
        ("start", "4", 4, 4), ("finish", "4", 4, 4)]
    assert events[2].name == "Scaler" and events[0].name == "MakeTensor"


def test_only_given_inputs_are_passed_and_hidden_inputs_on_request(record):
    workflow = tensor_chain()
    workflow["6"] = node("WhoAmI")
    result = run_workflow(workflow, REGISTRY)
    assert record.seen_kwargs == [{"factor": 2.0}]  # no offset given: none is passed
    assert result.outputs["6"] == {"uid": ["6"], "nodes": [["1", "2", "3", "4", "5", "6"]]}


def test_node_error_names_the_node(record):
    workflow = {"1": node("MakeTensor", size=2), "2": node("Fails", "Exploder", tensor=["1", 0]),
                "3": node("SaveValue", value=["2", 0], filename_prefix="x")}
    with pytest.raises(RunError) as excinfo:
        run_workflow(workflow, REGISTRY)
    error = excinfo.value
    assert not isinstance(error, RunInterrupted)
    assert str(error) == 'node 2 (Fails "Exploder"): RuntimeError: boom'
    assert (error.node_id, error.class_type, error.title) == ("2", "Fails", "Exploder")
    assert "raise RuntimeError(\"boom\")" in error.details
    assert "SaveValue" not in record.calls


def test_wrong_return_value_is_a_node_error():
    class ReturnsNumber(AddInts):
        def add(self, a, b):
            return a + b
    registry = {**REGISTRY, "ReturnsNumber": ReturnsNumber}
    workflow = {"1": node("ReturnsNumber", a=1, b=2),
                "2": node("SaveValue", value=["1", 0], filename_prefix="x")}
    with pytest.raises(RunError, match=r"node 1 \(ReturnsNumber\): TypeError: returned int; "
                                       r"expected a tuple"):
        run_workflow(workflow, registry)


def test_list_processing_nodes_are_refused_before_running(record):
    class ListNode(AddInts):
        INPUT_IS_LIST = True
    registry = {**REGISTRY, "ListNode": ListNode}
    workflow = {"1": node("ListNode", a=1, b=2),
                "2": node("SaveValue", value=["1", 0], filename_prefix="x"),
                "3": node("MakeTensor", size=1),
                "4": node("SaveValue", value=["3", 0], filename_prefix="y")}
    with pytest.raises(WorkflowError, match="list processing"):
        run_workflow(workflow, registry)
    assert record.calls == []


def test_progress_listener_is_forwarded_and_removed():
    workflow = {"1": node("MakeTensor", size=2), "2": node("Slow", tensor=["1", 0], steps=3),
                "3": node("SaveValue", value=["2", 0], filename_prefix="x")}
    events = []
    run_workflow(workflow, REGISTRY, on_event=events.append)
    progress = [(e.node_id, e.value, e.total) for e in events if e.kind == "progress"]
    assert progress == [("2", 1, 3), ("2", 2, 3), ("2", 3, 3)]
    assert host._listeners == []


def test_interrupt_during_a_node_stops_the_run(record):
    workflow = {"1": node("MakeTensor", size=2), "2": node("Slow", tensor=["1", 0], steps=2000),
                "3": node("SaveValue", value=["2", 0], filename_prefix="x")}
    Slow.STARTED.clear()
    timer = threading.Thread(target=lambda: (Slow.STARTED.wait(5), host.request_interrupt()))
    timer.start()
    with pytest.raises(RunInterrupted) as excinfo:
        run_workflow(workflow, REGISTRY)
    timer.join()
    assert str(excinfo.value) == "node 2 (Slow): interrupted"
    assert "SaveValue" not in record.calls
    gc.collect()
    assert all(r() is None for r in record.made)


def test_interrupt_between_nodes_stops_before_the_next_one(record):
    workflow = {"1": node("MakeTensor", size=2), "2": node("Stopper", tensor=["1", 0]),
                "3": node("SaveValue", value=["2", 0], filename_prefix="x")}
    with pytest.raises(RunInterrupted, match=r"interrupted before node 3 \(SaveValue\) ran"):
        run_workflow(workflow, REGISTRY)
    assert record.calls == ["MakeTensor", "Stopper"]
    host.request_interrupt()  # a stale request must not stop the next run
    run_workflow(tensor_chain(), REGISTRY)


# -- memory ------------------------------------------------------------------------------------

def test_tensors_made_in_a_run_are_freed_after_success(record):
    result = run_workflow(tensor_chain(), REGISTRY)
    assert len(record.made) == 2
    gc.collect()
    assert [r() for r in record.made] == [None, None]
    assert result.outputs  # the result keeps only the ui dicts


def test_intermediates_are_dropped_once_their_readers_ran():
    result = run_workflow(tensor_chain(last="AssertFreed") | {
        "6": node("SaveValue", value=["4", 0], filename_prefix="x")}, REGISTRY)
    assert result.outputs["4"] == {"alive": [0]}


def test_tensors_made_in_a_run_are_freed_after_a_failure(record):
    workflow = {"1": node("MakeTensor", size=2), "2": node("Fails", tensor=["1", 0]),
                "3": node("SaveValue", value=["2", 0], filename_prefix="x")}
    with pytest.raises(RunError) as excinfo:
        run_workflow(workflow, REGISTRY)
    assert len(record.made) == 2  # MakeTensor's output and Fails' local
    gc.collect()
    # the exception is still held (by excinfo) and must not keep them alive
    assert excinfo.value is not None
    assert [r() for r in record.made] == [None, None]


# -- overrides ---------------------------------------------------------------------------------

def sampler_workflow():
    return {
        "1": node("TextEncode", "Prompts", positive="a cat", negative=""),
        "2": node("Sampler", "My Sampler", positive=["1", 0], seed=1, steps=10, mode="fast",
                  flag=False),
        "3": node("SaveValue", value=["2", 0], filename_prefix="sample"),
        "4": node("SaveValue", "Second save", value=["2", 0], filename_prefix="copy"),
        "5": node("AddInts", a=1, b=2),
    }


def test_overrides_by_id_class_type_and_title():
    workflow = sampler_workflow()
    result = apply_overrides(workflow, [
        "2.steps=20", "Sampler.seed=42", "My Sampler.mode=slow", "my sampler.flag=TRUE",
        "Prompts.positive=a dog = happy", "Second save.filename_prefix= spaced "], REGISTRY)
    inputs = result["2"]["inputs"]
    assert (inputs["steps"], inputs["seed"], inputs["mode"], inputs["flag"]) == \
        (20, 42, "slow", True)
    assert result["1"]["inputs"]["positive"] == "a dog = happy"
    assert result["4"]["inputs"]["filename_prefix"] == " spaced "
    assert workflow["2"]["inputs"]["steps"] == 10  # the original is untouched


def test_override_replaces_a_link_with_a_value():
    workflow = sampler_workflow()
    workflow["2"]["inputs"]["seed"] = ["5", 0]
    result = apply_overrides(workflow, ["2.seed=9"], REGISTRY)
    assert result["2"]["inputs"]["seed"] == 9
    validate(result, REGISTRY)


@pytest.mark.parametrize("assignment, message", [
    ("SaveValue.filename_prefix=x",
     "'SaveValue' matches several nodes: 3 (SaveValue), 4 (SaveValue \"Second save\"); use the "
     "node id (or give the nodes distinct titles)"),
    ("Sampler.steps=many", "--set 'Sampler.steps=many': expected an integer (INT), got 'many'"),
    ("2.cfg=1.0", "node 2 (Sampler \"My Sampler\") has no input 'cfg'; its inputs: positive, "
                  "seed, steps, mode, flag"),
    ("Nothing.steps=1", "no node 'Nothing' in the workflow (by id, class_type or title); its "
                        "nodes: 1 (TextEncode \"Prompts\"), 2 (Sampler \"My Sampler\"), "
                        "3 (SaveValue), 4 (SaveValue \"Second save\"), 5 (AddInts)"),
    ("2.mode=medium", "--set '2.mode=medium': 'medium' is not one of the choices: "
                      "[\"fast\", \"slow\"]"),
    ("2.flag=yes", "--set '2.flag=yes': expected true or false, got 'yes'"),
    ("2.positive=x", "input 'positive' of node 2 (Sampler \"My Sampler\") takes a link "
                     "(CONDITIONING), not a value"),
    ("2steps=3", "--set '2steps=3': expected NODE.INPUT=VALUE"),
])
def test_override_errors_say_what_exists(assignment, message):
    with pytest.raises(OverrideError) as excinfo:
        apply_overrides(sampler_workflow(), [assignment], REGISTRY)
    assert message in str(excinfo.value)


# -- sweeps ------------------------------------------------------------------------------------

def test_sweep_product_order_and_shorthands(tmp_path):
    path = tmp_path / "sweep.json"
    path.write_text('{"prompt": ["a cat", "a dog"], "seed": [1, 2, 3], "2.steps": [5, "10"]}')
    jobs = expand_sweep(sampler_workflow(), load_sweep(path), REGISTRY)
    assert [tuple(j.settings.values()) for j in jobs][:4] == [
        ("a cat", 1, 5), ("a cat", 1, 10), ("a cat", 2, 5), ("a cat", 2, 10)]
    assert len(jobs) == 12 and [j.index for j in jobs] == list(range(1, 13))
    last = jobs[-1].workflow
    assert (last["1"]["inputs"]["positive"], last["2"]["inputs"]["seed"],
            last["2"]["inputs"]["steps"]) == ("a dog", 3, 10)
    assert len({j.job_key for j in jobs}) == 12
    again = expand_sweep(sampler_workflow(), load_sweep(path), REGISTRY)
    assert [j.job_key for j in again] == [j.job_key for j in jobs]  # stable across runs


def test_sweep_shorthand_ambiguity_and_bad_values(tmp_path):
    workflow = sampler_workflow()
    workflow["6"] = node("TextEncode", positive="x", negative="y")
    with pytest.raises(SweepError) as excinfo:
        expand_sweep(workflow, {"negative": ["bad"]}, REGISTRY)
    assert str(excinfo.value) == ("sweep key 'negative': ambiguous: several nodes have a STRING "
                                  "input 'negative' (1.negative, 6.negative); use NODE.INPUT "
                                  "instead")
    with pytest.raises(SweepError, match="sweep key 'seed', value 'x': expected an integer"):
        expand_sweep(sampler_workflow(), {"seed": ["x"]}, REGISTRY)
    with pytest.raises(SweepError, match="sweep keys 'seed' and '2.seed' both set"):
        expand_sweep(sampler_workflow(), {"seed": [1], "2.seed": [2]}, REGISTRY)
    path = tmp_path / "bad.json"
    path.write_text("[1, 2]")
    with pytest.raises(SweepError, match="bad.json: expected a JSON object"):
        load_sweep(path)


def mixed_sweep_workflow():
    workflow = sampler_workflow()
    workflow["6"] = node("FileChoice", path="a.txt", count=1)
    workflow["7"] = node("SaveValue", value=["6", 0], filename_prefix="f")
    return workflow


def test_a_sweep_is_a_sequence_built_job_by_job():
    sweep = {"6.path": ["a.txt", "b.png", "c.txt"], "seed": [0, -1, 5, 6],
             "2.steps": [1, 200], "6.count": [1, 3]}
    jobs = expand_sweep(mixed_sweep_workflow(), sweep, REGISTRY)
    listed = list(jobs)
    assert len(jobs) == len(listed) == 48
    for index in (0, 1, 17, 47, -1, -48):
        assert jobs[index] == listed[index]
    assert [j.settings for j in jobs[5:9]] == [j.settings for j in listed[5:9]]
    with pytest.raises(IndexError):
        jobs[48]
    # a job copies the nodes its settings change, and shares the others unchanged
    assert listed[0].workflow["1"] is jobs.workflow["1"]
    assert listed[0].workflow["2"] is not jobs.workflow["2"]
    assert jobs.workflow["2"]["inputs"]["seed"] == 1


def test_checking_a_sweep_equals_validating_every_job():
    """Independent keys (seed, steps, count) are checked value by value, the others (a path
    its node's VALIDATE_INPUTS judges) by whole validations: the verdict is what validating
    each job gives, each problem under the first job that has it."""
    from wan_enhanced.runner.sweep_checks import check_job, check_sweep, is_independent

    sweep = {"6.path": ["a.txt", "b.png", "c.txt"], "seed": [0, -1, 5, 6],
             "2.steps": [1, 200], "6.count": [1, 3]}
    jobs = expand_sweep(mixed_sweep_workflow(), sweep, REGISTRY)
    assert [k for k in sweep if is_independent(jobs, k, REGISTRY)] == \
        ["seed", "2.steps", "6.count"]
    invalid, first_with, seen = 0, [], set()
    for job in jobs:
        try:
            check_job(job, REGISTRY, None)
        except WorkflowError as exc:
            invalid += 1
            fresh = [str(i) for i in exc.errors if str(i) not in seen]
            seen.update(fresh)
            if fresh:
                first_with.append((job.index, sorted(fresh)))
    verdict = check_sweep(jobs, REGISTRY)
    assert invalid == 48 - 2 * 3 * 1 * 1 and verdict.invalid == invalid  # valid: 2 paths x 3 seeds
    assert [(job.index, sorted(problems)) for job, problems in verdict.reports] == first_with
    assert verdict.first is not None


def test_checking_a_sweep_of_100000_seeds_validates_one_workflow(monkeypatch):
    from wan_enhanced.runner import sweep_checks

    calls = []
    real = sweep_checks.validate
    monkeypatch.setattr(sweep_checks, "validate", lambda *a, **k: calls.append(1) or real(*a, **k))
    jobs = expand_sweep(sampler_workflow(), {"seed": list(range(-2, 99998))}, REGISTRY)
    verdict = sweep_checks.check_sweep(jobs, REGISTRY)
    assert len(calls) == 1 and verdict.invalid == 2
    assert [(job.index, job.settings) for job, _ in verdict.reports] == \
        [(1, {"seed": -2}), (2, {"seed": -1})]
    assert jobs[-1].settings == {"seed": 99997}


def test_results_log_ignores_a_torn_last_line_and_keeps_appending(tmp_path):
    path = tmp_path / "results.jsonl"
    log = ResultsLog(path)
    log.append(result_record("k1", {"seed": 1}, status="success", seconds=1.0, files=["a"],
                             run_id="r1"))
    log.append(result_record("k2", {"seed": 2}, status="error", seconds=1.0, files=[],
                             run_id="r2", error="boom"))
    with open(path, "ab") as f:
        f.write(b'{"job_key": "k3", "status": "succ')  # a crash in the middle of a write
    reopened = ResultsLog(path)
    assert reopened.succeeded() == {"k1"}
    assert reopened.warnings == [f"results file {path}: its last line is incomplete (an "
                                 "interrupted write); ignored"]
    reopened.append(result_record("k3", {}, status="success", seconds=2.0, files=[],
                                  run_id="r3"))
    assert ResultsLog(path).succeeded() == {"k1", "k3"}
    line = json.loads(path.read_text().splitlines()[-1])
    assert set(line) == {"job_key", "settings", "run_id", "status", "outputs", "seconds",
                         "peak_memory", "error", "finished_at"}


# -- the command -------------------------------------------------------------------------------

@pytest.fixture
def registry_installed(monkeypatch):
    monkeypatch.setattr(wan_enhanced, "NODE_CLASS_MAPPINGS", REGISTRY)


def write(path: Path, data) -> Path:
    path.write_text(json.dumps(data))
    return path


def test_run_command_exit_codes(tmp_path, registry_installed, capsys):
    good = write(tmp_path / "good.json", tensor_chain())
    out = tmp_path / "cli-out"
    assert cli.main(["run", str(good), "--out", str(out), "--set", "1.size=4", "--quiet"]) == 0
    assert json.loads((out / "total.json").read_text()) == 8.0
    captured = capsys.readouterr()
    assert "finished in" in captured.out and str(out / "total.json") in captured.out

    bad = tensor_chain()
    bad["1"]["inputs"]["size"] = 0
    assert cli.main(["run", str(write(tmp_path / "bad.json", bad)), "--out", str(out)]) == 2
    assert 'node 1 (MakeTensor), input "size": value 0 is smaller than the minimum 1' in \
        capsys.readouterr().err
    assert cli.main(["run", str(good), "--set", "1.nope=1"]) == 2

    failing = {"1": node("MakeTensor", size=2), "2": node("Fails", tensor=["1", 0]),
               "3": node("SaveValue", value=["2", 0], filename_prefix="x")}
    assert cli.main(["run", str(write(tmp_path / "f.json", failing)), "--out", str(out)]) == 1
    assert "failed: node 2 (Fails): RuntimeError: boom" in capsys.readouterr().err


def test_run_command_progress_lines_when_not_a_terminal(tmp_path, registry_installed, capsys):
    workflow = {"1": node("MakeTensor", size=2), "2": node("Slow", tensor=["1", 0], steps=2),
                "3": node("SaveValue", value=["2", 0], filename_prefix="x")}
    path = write(tmp_path / "wf.json", workflow)
    assert cli.main(["run", str(path), "--out", str(tmp_path / "o")]) == 0
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == "[1/3] MakeTensor ..."
    assert lines[3].startswith("[2/3] Slow  step 1/2  ")
    assert lines[4].startswith("[2/3] Slow  step 2/2  ")
    assert lines[5].startswith("[2/3] Slow  done in ")
    assert "\r" not in "".join(lines)


def test_sweep_resumes_after_a_crash(tmp_path, registry_installed, capsys, record):
    workflow = write(tmp_path / "wf.json", sampler_workflow())
    sweep = write(tmp_path / "sweep.json", {"prompt": ["a cat", "a dog"], "seed": [1, 2]})
    out = tmp_path / "out"
    assert cli.main(["run", str(workflow), "--sweep", str(sweep), "--out", str(out),
                     "--quiet"]) == 0
    results = tmp_path / "sweep.results.jsonl"
    lines = [json.loads(line) for line in results.read_text().splitlines()]
    assert [line["settings"] for line in lines] == [
        {"prompt": "a cat", "seed": 1}, {"prompt": "a cat", "seed": 2},
        {"prompt": "a dog", "seed": 1}, {"prompt": "a dog", "seed": 2}]
    assert all(line["status"] == "success" for line in lines)
    assert lines[0]["outputs"] == [str(out / "sample.json"), str(out / "copy.json")]
    assert lines[0]["peak_memory"]["rss"] > 0

    # a crash while the last line was being written: that job runs again, the others do not
    text = results.read_text()
    results.write_text(text[:text.rindex("\n", 0, len(text) - 1) + 1] + text[-40:-5])
    record.calls.clear()
    capsys.readouterr()
    assert cli.main(["run", str(workflow), "--sweep", str(sweep), "--out", str(out),
                     "--quiet"]) == 0
    err = capsys.readouterr().err
    assert "its last line is incomplete" in err
    assert "3 of 4 job(s) already succeeded" in err
    assert record.calls.count("Sampler") == 1
    assert ResultsLog(results).succeeded() == {line["job_key"] for line in lines}


def test_sweep_with_an_invalid_value_runs_nothing(tmp_path, registry_installed, capsys, record):
    workflow = write(tmp_path / "wf.json", sampler_workflow())
    sweep = write(tmp_path / "sweep.json", {"2.steps": [5, 500, 1000]})
    assert cli.main(["run", str(workflow), "--sweep", str(sweep), "--results",
                     str(tmp_path / "r.jsonl")]) == 2
    err = capsys.readouterr().err
    assert "job 2/3: 2.steps=500\n  - node 2 (Sampler \"My Sampler\"), input \"steps\": " \
           "value 500 is bigger than the maximum 100" in err
    assert "2 of 3 job(s) are invalid; nothing ran" in err
    assert record.calls == [] and not (tmp_path / "r.jsonl").exists()


def test_ctrl_c_stops_the_run_and_records_it(tmp_path, registry_installed, interactive_sigint,
                                            capsys):
    workflow = {"1": node("MakeTensor", size=2), "2": node("Slow", tensor=["1", 0], steps=2000),
                "3": node("SaveValue", value=["2", 0], filename_prefix="x")}
    path = write(tmp_path / "wf.json", workflow)
    results = tmp_path / "r.jsonl"
    Slow.STARTED.clear()
    presser = threading.Thread(target=lambda: (Slow.STARTED.wait(5),
                                               os.kill(os.getpid(), signal.SIGINT)))
    presser.start()
    code = cli.main(["run", str(path), "--out", str(tmp_path / "o"), "--results", str(results),
                     "--quiet"])
    presser.join()
    assert code == 1
    assert "interrupted: node 2 (Slow): interrupted" in capsys.readouterr().err
    assert json.loads(results.read_text())["status"] == "interrupted"
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


@pytest.mark.parametrize("sigint, code, statuses", [
    ("interactive_sigint", 1, ["interrupted"]),  # and the second job does not start
    ("ignored_sigint", 0, ["success", "success"]),
])
def test_ctrl_c_stops_a_run_unless_sigint_was_ignored_at_start(
        sigint, code, statuses, tmp_path, registry_installed, record, request, capsys):
    """A run started with SIGINT ignored (`wan-enhanced run ... &` in a script) is a background
    job: Ctrl-C in the terminal is not meant for it, and it runs to its end."""
    request.getfixturevalue(sigint)
    handler = signal.getsignal(signal.SIGINT)
    workflow = {"1": node("MakeTensor", size=2), "2": node("PressCtrlC", tensor=["1", 0]),
                "3": node("SaveValue", value=["2", 0], filename_prefix="x")}
    path = write(tmp_path / "wf.json", workflow)
    sweep = write(tmp_path / "sweep.json", {"1.size": [2, 3]})
    results = tmp_path / "r.jsonl"
    assert cli.main(["run", str(path), "--out", str(tmp_path / "o"), "--sweep", str(sweep),
                     "--results", str(results), "--quiet"]) == code, capsys.readouterr().err
    assert [json.loads(line)["status"] for line in results.read_text().splitlines()] == statuses
    assert record.calls.count("PressCtrlC") == len(statuses)
    assert signal.getsignal(signal.SIGINT) == handler  # put back, or never replaced


def _statuses(results: Path) -> list[str]:
    return [json.loads(line)["status"] for line in results.read_text().splitlines()]


@pytest.mark.parametrize("sigint", ["interactive_sigint", "ignored_sigint"])
def test_sigterm_stops_a_run_as_ctrl_c_does_also_where_sigint_was_ignored_at_start(
        sigint, tmp_path, registry_installed, record, request, stray_sigterm, capsys):
    """`kill` (SIGTERM) during a run: the node stops at its next check, the job is recorded as
    interrupted, the next one does not start, exit 1; also in a background job (SIGINT ignored),
    which Ctrl-C cannot stop."""
    request.getfixturevalue(sigint)
    handlers = [signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)]
    workflow = {"1": node("MakeTensor", size=2), "2": node("Kill", tensor=["1", 0]),
                "3": node("SaveValue", value=["2", 0], filename_prefix="x")}
    path = write(tmp_path / "wf.json", workflow)
    sweep = write(tmp_path / "sweep.json", {"1.size": [2, 3]})
    results = tmp_path / "r.jsonl"
    code = cli.main(["run", str(path), "--out", str(tmp_path / "o"), "--sweep", str(sweep),
                     "--results", str(results), "--quiet"])
    err = capsys.readouterr().err
    assert code == 1, err
    assert _statuses(results) == ["interrupted"] and record.calls.count("Kill") == 1
    assert "interrupted: node 2 (Kill): interrupted" in err
    assert stray_sigterm == []  # the run's handler took it
    assert [signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)] == handlers


@pytest.mark.parametrize("second", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_second_signal_while_the_interrupted_job_is_recorded_cuts_nothing(
        second, tmp_path, registry_installed, record, interactive_sigint, stray_sigterm,
        monkeypatch, capsys):
    """The second signal stops a running job at once; arriving while the stopped job's line is
    written (an impatient `kill`, Ctrl-C), it leaves the line whole and the exit code 1."""
    append = ResultsLog.append

    def signal_then_append(log, line):
        os.kill(os.getpid(), second)
        append(log, line)

    monkeypatch.setattr(ResultsLog, "append", signal_then_append)
    workflow = {"1": node("MakeTensor", size=2), "2": node("Kill", tensor=["1", 0]),
                "3": node("SaveValue", value=["2", 0], filename_prefix="x")}
    path = write(tmp_path / "wf.json", workflow)
    results = tmp_path / "r.jsonl"
    code = cli.main(["run", str(path), "--out", str(tmp_path / "o"), "--results", str(results),
                     "--quiet"])
    err = capsys.readouterr().err
    assert code == 1, err
    assert _statuses(results) == ["interrupted"] and stray_sigterm == []
    assert "Traceback" not in err


def test_progress_display_redraws_one_line_on_a_terminal():
    import io
    from wan_enhanced.runner.executor import RunEvent
    from wan_enhanced.runner.run_command import ProgressDisplay

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    screen = Terminal()
    display = ProgressDisplay(screen)
    display(RunEvent("start", "2", "Sampler", "My Sampler", 2, 3))
    display(RunEvent("progress", "2", "Sampler", "My Sampler", 2, 3, value=1, total=30,
                     seconds=1.25))
    display(RunEvent("finish", "2", "Sampler", "My Sampler", 2, 3, seconds=75.0))
    assert screen.getvalue() == ("\r[2/3] My Sampler ..."
                                 "\r[2/3] My Sampler  step 1/30  1.2 s"
                                 "\r[2/3] My Sampler  done in 1 min 15 s\n")


def test_cuda_peak_includes_the_peaks_the_event_log_recorded(monkeypatch):
    from wan_enhanced.profiling import events, snapshot

    class RecordsEvent(AddInts):
        def add(self, a, b):
            events.record_event("inside", stage="test")
            return (a + b,)

    def fake_snapshot(device=None):
        reading = snapshot.take_snapshot(device)
        # far above anything real, so the check also holds where CUDA is in use
        return {**reading, "cuda_max_allocated_bytes": 7 << 40, "cuda_max_reserved_bytes": 9 << 40}

    events.record_event("before the run", stage="test")  # a peak outside the run: not counted
    monkeypatch.setattr(events, "take_snapshot", fake_snapshot)
    registry = {**REGISTRY, "RecordsEvent": RecordsEvent}
    workflow = {"1": node("RecordsEvent", a=1, b=2),
                "2": node("SaveValue", value=["1", 0], filename_prefix="x")}
    peak = run_workflow(workflow, registry).peak
    assert (peak.allocated, peak.reserved) == (7 << 40, 9 << 40)
    monkeypatch.undo()
    events.record_event("between runs", stage="test")
    if not torch.cuda.is_available():
        assert run_workflow(workflow, {**REGISTRY, "RecordsEvent": AddInts}).peak.allocated is None


def test_set_takes_an_absolute_model_path_as_the_workflow_json_does(tmp_path):
    """A loader checks its file itself (ComfyUI's choice check is off for it): --set takes the
    path the same JSON takes, and the loader's check judges both alike."""
    from wan_enhanced.checkpoints import tiny
    from wan_enhanced.runner.headless_nodes import local_registry

    registry = local_registry()
    model = tiny.write_dit(tmp_path / "elsewhere" / "dit.safetensors", tiny.TINY_DIT["t2v"],
                           "comfy")
    probe = node("WanEnhancedMemoryProbe", value=["1", 0], label="loaded")  # an output
    workflow = {"1": node("WanEnhancedModelLoader", model_name="x.safetensors",
                          weight_dtype="auto", attention="auto"), "2": probe}
    set_ = apply_overrides(workflow, [f"1.model_name={model}"], registry)
    written = {"1": node("WanEnhancedModelLoader", model_name=str(model), weight_dtype="auto",
                         attention="auto"), "2": probe}
    assert set_ == written
    validate(set_, registry)  # the file exists: accepted, as the same JSON is
    validate(written, registry)
    missing = apply_overrides(workflow, [f"1.model_name={tmp_path / 'none.safetensors'}"],
                              registry)
    with pytest.raises(WorkflowError, match=r'input "model_name".*none\.safetensors'):
        validate(missing, registry)
    with pytest.raises(OverrideError, match="'bf17' is not one of the choices"):
        apply_overrides(workflow, ["1.weight_dtype=bf17"], registry)  # ComfyUI's own check
