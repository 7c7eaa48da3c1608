"""The runner's node cache (runner/node_cache.py): a second run reuses the outputs of every node
whose signature (class, IS_CHANGED, constants, everything upstream) is unchanged, as a ComfyUI
0.3.64 server with its default cache does, and holds no more than one run's outputs.

The fake nodes count their calls; identities and weak references show which objects are handed
on and which are freed. PARITY holds prompts in order with the nodes ComfyUI 0.3.64's
PromptExecutor ran for each (recorded from it); test_parity_scenarios checks this runner against
the table, test_parity_scenarios_in_comfyui checks the table against ComfyUI itself where a
ComfyUI host is set up (COMFYUI_HOME, tools/comfyui_host.sh)."""

from __future__ import annotations

import copy
import gc
import json
import logging
import math
import os
import subprocess
import textwrap
import threading
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from wan_enhanced import host
from wan_enhanced.nodes.common import ANY
from wan_enhanced.runner.executor import RunError, RunInterrupted, execute, run_workflow
from wan_enhanced.runner.node_cache import NodeCache, node_signatures
from wan_enhanced.runner.workflow import validate


@dataclass
class Recorder:
    calls: list[str] = field(default_factory=list)  # "Class:detail" in the order they ran
    made: list[weakref.ref] = field(default_factory=list)  # every tensor the nodes made
    received: list = field(default_factory=list)  # the very objects Scale and Keep got
    is_changed: list[dict] = field(default_factory=list)  # IS_CHANGED's arguments
    instances: list = field(default_factory=list)  # every node instance that ran
    alive_at_start: list[int] = field(default_factory=list)  # Probe: earlier tensors alive


class FakeNode:
    record: Recorder

    def _ran(self, detail=""):
        self.record.calls.append(f"{type(self).__name__}:{detail}" if detail else
                                 type(self).__name__)
        self.record.instances.append(self)


class MakeTensor(FakeNode):
    """The loader: a tensor of `size` ones (`name` tells loads apart)."""

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"size": ("INT", {"default": 4, "min": 1, "max": 64})},
                "optional": {"name": ("STRING", {"default": "a"})}}

    RETURN_TYPES = ("TENSOR", "INT")
    FUNCTION = "make"

    def make(self, size, name="a"):
        self._ran(str(size))
        tensor = torch.ones(size)
        self.record.made.append(weakref.ref(tensor))
        return (tensor, size)


class Scale(FakeNode):
    """The sampler: `seed` changes what it makes."""

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"tensor": ("TENSOR",), "seed": ("INT", {"default": 0})}}

    RETURN_TYPES = ("TENSOR",)
    FUNCTION = "scale"

    def scale(self, tensor, seed):
        self._ran(str(seed))
        self.record.received.append(tensor)
        if seed < 0:
            raise RuntimeError("negative seed")
        result = tensor * seed
        self.record.made.append(weakref.ref(result))
        return (result,)


class Decode(FakeNode):
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"tensor": ("TENSOR",)}}

    RETURN_TYPES = ("FLOAT",)
    FUNCTION = "decode"

    def decode(self, tensor):
        self._ran()
        return (float(tensor.sum()),)


class Save(FakeNode):
    """The output node: writes PREFIX-N.json (a new N each time it runs)."""

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"value": (ANY,)},
                "optional": {"filename_prefix": ("STRING", {"default": "out"})}}

    RETURN_TYPES = ()
    FUNCTION = "save"
    OUTPUT_NODE = True

    def save(self, value, filename_prefix="out", unique_id=None):
        self._ran(filename_prefix)
        folder = host.output_directory()
        folder.mkdir(parents=True, exist_ok=True)
        name = f"{filename_prefix}-{len(list(folder.glob(filename_prefix + '-*')))}.json"
        (folder / name).write_text(json.dumps(value if not isinstance(value, torch.Tensor)
                                              else value.tolist()))
        return {"ui": {"files": [{"filename": name, "subfolder": "", "type": "output"}]}}


class SaveWithId(Save):
    """An output node declaring UNIQUE_ID, like every node of this package."""

    @classmethod
    def INPUT_TYPES(cls):
        return {**super().INPUT_TYPES(), "hidden": {"unique_id": "UNIQUE_ID"}}


class Keep(FakeNode):
    """Returns its input unchanged (and remembers the very object it got)."""

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"value": (ANY,)}}

    RETURN_TYPES = (ANY,)
    FUNCTION = "keep"

    def keep(self, value):
        self._ran()
        self.record.received.append(value)
        return (value,)


class Changing(Keep):
    """A pass-through whose IS_CHANGED answers what `answer` (set by the test) returns."""

    answer = staticmethod(lambda: "same")

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"value": (ANY,), "label": ("STRING", {"default": "x"})},
                "optional": {"unset": ("INT", {"default": 3})},
                "hidden": {"uid": "UNIQUE_ID", "prompt": "PROMPT", "info": "EXTRA_PNGINFO"}}

    @classmethod
    def IS_CHANGED(cls, **inputs):
        cls.record.is_changed.append(inputs)
        return cls.answer()

    def keep(self, value, label, uid=None, prompt=None, info=None):
        return super().keep(value)


class Fails(FakeNode):
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"tensor": ("TENSOR",)}}

    RETURN_TYPES = ("TENSOR",)
    FUNCTION = "explode"

    def explode(self, tensor):
        self._ran()
        local = tensor * 2  # made by the failing node: must not stay referenced
        self.record.made.append(weakref.ref(local))
        raise RuntimeError("boom")


class ReturnsNumber(Decode):
    def decode(self, tensor):
        self._ran()
        return 1.0  # not a tuple: a node error after the method returned


class Slow(Keep):
    STARTED = threading.Event()

    def keep(self, value):
        self._ran()
        for _ in range(2000):
            Slow.STARTED.set()
            host.check_interrupt()
            threading.Event().wait(0.005)
        return (value,)


class Probe(Scale):
    """A sampler that counts the tensors of earlier runs still alive when it starts."""

    def scale(self, tensor, seed):
        gc.collect()
        self.record.alive_at_start.append(sum(r() is not None for r in self.record.made))
        return super().scale(tensor, seed)


REGISTRY = {cls.__name__: cls for cls in (MakeTensor, Scale, Decode, Save, SaveWithId, Keep,
                                           Changing, Fails, ReturnsNumber, Slow, Probe)}


@pytest.fixture(autouse=True)
def record(tmp_path):
    FakeNode.record = Recorder()
    Changing.answer = staticmethod(lambda: "same")
    host.clear_interrupt()
    host.set_headless_folders(output=tmp_path / "out")
    yield FakeNode.record
    host.clear_interrupt()
    host.set_headless_folders(output="output")


def node(class_type, **inputs):
    return {"class_type": class_type, "inputs": inputs}


def chain(size=3, seed=2, prefix="video", save="Save", sampler="Scale"):
    """loader 1 -> sampler 2 -> decode 3 -> save 4."""
    return {"1": node("MakeTensor", size=size), "2": node(sampler, tensor=["1", 0], seed=seed),
            "3": node("Decode", tensor=["2", 0]),
            "4": node(save, value=["3", 0], filename_prefix=prefix)}


def run(workflow, cache, events=None):
    return run_workflow(workflow, REGISTRY, cache=cache,
                        on_event=None if events is None else events.append)


def kinds(events):
    return [(e.kind, e.node_id, e.index, e.count) for e in events if e.kind != "progress"]


# -- reuse -------------------------------------------------------------------------------------

def test_a_second_run_of_the_same_workflow_runs_no_node(record, tmp_path):
    cache = NodeCache()
    first = run(chain(), cache)
    assert record.calls == ["MakeTensor:3", "Scale:2", "Decode", "Save:video"]
    assert len(cache) == 4 and cache.node_ids() == ["1", "2", "3", "4"]
    record.calls.clear()
    events = []
    second = run(chain(), cache, events)
    assert record.calls == []
    assert kinds(events) == [("cached", "1", 1, 4), ("cached", "2", 2, 4),
                             ("cached", "3", 3, 4), ("cached", "4", 4, 4)]
    assert all(e.seconds == 0.0 for e in events)
    assert second.node_seconds == {"1": 0.0, "2": 0.0, "3": 0.0, "4": 0.0}
    # the unchanged output node answers with its earlier ui, as a ComfyUI server's history does
    assert second.outputs == first.outputs and second.outputs["4"] is first.outputs["4"]
    assert second.files == first.files == [str(tmp_path / "out" / "video-0.json")]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["video-0.json"]


def test_a_new_seed_reruns_the_sampler_and_everything_downstream_not_upstream(record):
    cache = NodeCache()
    run(chain(seed=2), cache)
    loaded = cache.lookup("1").outputs[0]
    record.calls.clear()
    events = []
    result = run(chain(seed=5), cache, events)
    assert record.calls == ["Scale:5", "Decode", "Save:video"]
    assert kinds(events) == [("cached", "1", 1, 4), ("start", "2", 2, 4), ("finish", "2", 2, 4),
                             ("start", "3", 3, 4), ("finish", "3", 3, 4), ("start", "4", 4, 4),
                             ("finish", "4", 4, 4)]
    assert result.node_seconds["1"] == 0.0 and result.node_seconds["2"] > 0.0
    assert record.received[-1] is loaded  # the sampler got the cached tensor itself
    assert result.outputs["4"]["files"][0]["filename"] == "video-1.json"


def test_a_changed_loader_input_reruns_the_loader_and_everything_downstream(record):
    cache = NodeCache()
    run(chain(size=3), cache)
    record.calls.clear()
    run(chain(size=5), cache)
    assert record.calls == ["MakeTensor:5", "Scale:2", "Decode", "Save:video"]
    record.calls.clear()
    run(chain(size=5, prefix="other"), cache)  # only the output node's own input changed
    assert record.calls == ["Save:other"]


def test_readers_of_a_cached_node_get_the_very_cached_objects(record):
    cache = NodeCache()
    workflow = {"1": node("MakeTensor", size=2), "2": node("Keep", value=["1", 0]),
                "3": node("Keep", value=["1", 1]), "4": node("Save", value=["2", 0]),
                "5": node("Save", value=["3", 0], filename_prefix="n")}
    run(workflow, cache)
    tensor, size = cache.lookup("1").outputs
    assert record.received[0] is tensor and record.received[1:] == [size]
    record.received.clear()
    workflow["4"]["inputs"]["filename_prefix"] = "again"
    workflow["2"] = node("Scale", tensor=["1", 0], seed=3)  # a new reader of the cached loader
    run(workflow, cache)
    assert record.received[0] is tensor
    assert cache.lookup("1").outputs[0] is tensor


def test_node_instances_are_kept_per_node_id_as_a_server_keeps_them(record):
    cache = NodeCache()
    run(chain(seed=1), cache)
    sampler = record.instances[1]
    run(chain(seed=2), cache)
    assert record.instances[4] is sampler
    run(chain(seed=3), None)  # without a cache: a fresh instance every run
    assert record.instances[-3] is not sampler


def test_identical_nodes_of_one_run_run_once(record):
    """ComfyUI keys outputs by signature, not by node: two loaders with the same inputs (and no
    UNIQUE_ID) are one; output nodes with UNIQUE_ID are keyed by their id too."""
    cache = NodeCache()
    workflow = {"1": node("MakeTensor", size=2), "2": node("MakeTensor", size=2),
                "3": node("SaveWithId", value=["1", 0]), "4": node("SaveWithId", value=["2", 0])}
    events = []
    run(workflow, cache, events)
    assert record.calls == ["MakeTensor:2", "SaveWithId:out", "SaveWithId:out"]
    assert ("cached", "2") in [(e.kind, e.node_id) for e in events]
    assert cache.lookup("1") is cache.lookup("2") and len(cache) == 3


def test_nodes_declaring_unique_id_are_keyed_by_their_node_id(record):
    cache = NodeCache()
    run(chain(save="SaveWithId"), cache)
    renumbered = chain(save="SaveWithId")
    renumbered["9"] = renumbered.pop("4")
    record.calls.clear()
    run(renumbered, cache)
    assert record.calls == ["SaveWithId:video"]  # the others, without UNIQUE_ID, are reused


def test_without_a_cache_nothing_is_reused_or_kept(record):
    cache = NodeCache()
    run(chain(), cache)
    record.calls.clear()
    before = {k: cache.lookup(k) for k in cache.node_ids()}
    run(chain(), None)
    assert record.calls == ["MakeTensor:3", "Scale:2", "Decode", "Save:video"]
    assert {k: cache.lookup(k) for k in cache.node_ids()} == before
    record.received.clear()
    gc.collect()
    assert [r() is None for r in record.made] == [False, False, True, True]  # the cache's two


# -- what the cache holds ----------------------------------------------------------------------

def test_a_different_workflow_drops_the_entries_it_cannot_use(record):
    cache = NodeCache()
    run(chain(size=3), cache)
    first_tensors = list(record.made)
    other = {"7": node("MakeTensor", size=4), "8": node("Save", value=["7", 1])}
    run(other, cache)
    record.received.clear()
    gc.collect()
    assert [r() for r in first_tensors] == [None, None]
    assert len(cache) == 2 and cache.node_ids() == ["7", "8"]
    record.calls.clear()
    run(chain(size=3), cache)  # its entries are gone: everything runs again
    assert record.calls == ["MakeTensor:3", "Scale:2", "Decode", "Save:video"]


def test_a_new_seed_frees_the_previous_outputs_before_its_nodes_run(record):
    cache = NodeCache()
    for seed in (1, 2, 3):
        run(chain(seed=seed, sampler="Probe"), cache)
    # at each start only the cached loader's tensor is alive: the previous sampler output was
    # dropped as the run began, before any node ran
    assert record.alive_at_start == [1, 1, 1]
    assert len(cache) == 4
    cache.clear()
    record.received.clear()
    gc.collect()
    assert len(cache) == 0 and all(r() is None for r in record.made)


def test_a_failed_run_keeps_only_the_nodes_that_finished(record):
    cache = NodeCache()
    run(chain(size=5), cache)  # entries the failed run cannot use must go as well
    earlier = list(record.made)
    workflow = {"1": node("MakeTensor", size=3), "2": node("Fails", tensor=["1", 0]),
                "3": node("Save", value=["2", 0])}
    with pytest.raises(RunError, match="boom"):
        run(workflow, cache)
    assert cache.node_ids() == ["1"] and len(cache) == 1
    record.received.clear()
    gc.collect()
    assert [r() is None for r in earlier] == [True, True]
    assert record.made[2]() is cache.lookup("1").outputs[0]  # the finished loader's output
    assert record.made[3]() is None  # the failing node's own tensor
    record.calls.clear()
    run({**workflow, "2": node("Scale", tensor=["1", 0], seed=2)}, cache)
    assert record.calls == ["Scale:2", "Save:out"]  # the loader's output reused


def test_a_node_that_returned_a_bad_value_is_not_cached(record):
    cache = NodeCache()
    workflow = {"1": node("MakeTensor", size=3), "2": node("ReturnsNumber", tensor=["1", 0]),
                "3": node("Save", value=["2", 0])}
    with pytest.raises(RunError, match="returned float"):
        run(workflow, cache)
    assert cache.node_ids() == ["1"]


def test_an_interrupted_run_keeps_only_the_nodes_that_finished(record):
    cache = NodeCache()
    workflow = {"1": node("MakeTensor", size=3), "2": node("Slow", value=["1", 0]),
                "3": node("Save", value=["2", 0])}
    Slow.STARTED.clear()
    timer = threading.Thread(target=lambda: (Slow.STARTED.wait(5), host.request_interrupt()))
    timer.start()
    with pytest.raises(RunInterrupted):
        run(workflow, cache)
    timer.join()
    assert cache.node_ids() == ["1"]
    record.calls.clear()
    host.clear_interrupt()
    events = []
    run({**workflow, "2": node("Keep", value=["1", 0])}, cache, events)
    assert record.calls == ["Keep", "Save:out"]
    assert kinds(events)[0] == ("cached", "1", 1, 3)


def test_an_interrupt_stops_the_run_before_a_cached_node_too(record):
    cache = NodeCache()
    run(chain(), cache)

    def stop_after_the_loader(event):
        if event.kind == "cached" and event.node_id == "1":
            host.request_interrupt()

    with pytest.raises(RunInterrupted, match=r"interrupted before node 2 \(Scale\) ran"):
        run_workflow(chain(), REGISTRY, cache=cache, on_event=stop_after_the_loader)
    assert len(cache) == 4  # the same signatures: nothing to drop
    host.clear_interrupt()
    record.calls.clear()
    run(chain(), cache)
    assert record.calls == []


# -- IS_CHANGED --------------------------------------------------------------------------------

def is_changed_workflow():
    return {"1": node("MakeTensor", size=3), "2": node("Changing", value=["1", 0], label="p"),
            "3": node("Decode", tensor=["2", 0]), "4": node("Save", value=["3", 0])}


def test_is_changed_is_called_once_per_run_on_the_class_with_constants_and_none_for_links(
        record):
    cache = NodeCache()
    run(is_changed_workflow(), cache)
    run(is_changed_workflow(), cache)
    # linked inputs as None, no default for an input not given, hidden as ComfyUI passes them
    assert record.is_changed == [{"value": None, "label": "p", "uid": "2", "prompt": {},
                                  "info": None}] * 2
    assert record.calls == ["MakeTensor:3", "Changing", "Decode", "Save:out"]


SAME_NAN = float("nan")


@pytest.mark.parametrize("answer, reruns", [
    (lambda: "same", False),
    (lambda: [1, {"a": 2}], False),  # equal lists and dicts are equal
    (lambda: None, False),
    (lambda: float("nan"), True),  # a new NaN each call: never equal
    (lambda: SAME_NAN, False),  # the same NaN object: equal to itself, reused (as in ComfyUI)
    (lambda: math.nan, False),
    (lambda: object(), True),  # not comparable: always new
    (lambda: torch.zeros(1), True),
])
def test_is_changed_value_decides_like_comfyui(record, answer, reruns):
    cache = NodeCache()
    Changing.answer = staticmethod(answer)
    run(is_changed_workflow(), cache)
    record.calls.clear()
    run(is_changed_workflow(), cache)
    assert record.calls == (["Changing", "Decode", "Save:out"] if reruns else [])


def test_a_changing_is_changed_reruns_the_node_and_downstream(record):
    cache = NodeCache()
    counter = iter(range(100))
    Changing.answer = staticmethod(lambda: next(counter))
    run(is_changed_workflow(), cache)
    record.calls.clear()
    run(is_changed_workflow(), cache)
    assert record.calls == ["Changing", "Decode", "Save:out"]  # not the loader upstream


def test_an_is_changed_that_raises_reruns_the_node_with_a_warning(record, caplog):
    def broken():
        raise ValueError("no file")
    Changing.answer = staticmethod(broken)
    cache = NodeCache()
    run(is_changed_workflow(), cache)
    record.calls.clear()
    with caplog.at_level(logging.WARNING):
        run(is_changed_workflow(), cache)
    assert record.calls == ["Changing", "Decode", "Save:out"]
    assert "IS_CHANGED raised ValueError: no file" in caplog.text


def test_only_a_memory_probe_that_writes_the_log_runs_every_time(record, tmp_path):
    """Of this package's nodes only the memory probe defines IS_CHANGED: a probe that writes
    the run's log runs in every run (a new NaN), and everything downstream of it with it, as in
    ComfyUI; a probe that only records stays cached with the nodes after it."""
    from wan_enhanced.nodes import NODE_CLASS_MAPPINGS
    assert sorted(n for n, c in NODE_CLASS_MAPPINGS.items() if hasattr(c, "IS_CHANGED")) == \
        ["WanEnhancedMemoryProbe"]
    registry = {**REGISTRY, "WanEnhancedMemoryProbe": NODE_CLASS_MAPPINGS["WanEnhancedMemoryProbe"]}

    def workflow(**probe_options):
        return {"1": node("MakeTensor", size=3),
                "2": node("WanEnhancedMemoryProbe", value=["1", 0], label="loaded",
                          **probe_options),
                "3": node("Decode", tensor=["2", 0]), "4": node("Save", value=["3", 0])}

    host.set_headless_folders(output=tmp_path)
    try:
        for options, again in (({}, []), ({"save_log": "probe.json"}, ["Decode", "Save:out"])):
            cache = NodeCache()
            validated = validate(workflow(**options), registry)
            signatures = [node_signatures(validated, registry)["2"] for _ in range(2)]
            assert (signatures[0] == signatures[1]) == (not options)
            first = run_workflow(workflow(**options), registry, cache=cache)
            record.calls.clear()
            second = run_workflow(workflow(**options), registry, cache=cache)
            assert record.calls == again
            assert (second.outputs["2"] != first.outputs["2"]) == bool(options)  # a new event
            assert second.node_seconds["1"] == 0.0
    finally:
        host.set_headless_folders(output="output")


# -- parity with ComfyUI 0.3.64 ----------------------------------------------------------------

# Fake nodes both runners load (this test in-process, ComfyUI in its own process).
PARITY_NODES = textwrap.dedent('''
    import math
    CALLS = []
    MODE = {"answer": "const"}
    SAME_NAN = float("nan")

    class PLoader:
        @classmethod
        def INPUT_TYPES(cls):
            return {"required": {"name": ("STRING", {"default": "a"})}}
        RETURN_TYPES = ("PMODEL",)
        FUNCTION = "load"
        def load(self, name):
            CALLS.append("PLoader:" + name)
            return ({"model": name},)

    class PSampler:
        @classmethod
        def INPUT_TYPES(cls):
            return {"required": {"model": ("PMODEL",), "seed": ("INT", {"default": 0})}}
        RETURN_TYPES = ("PLATENT",)
        FUNCTION = "sample"
        def sample(self, model, seed):
            CALLS.append("PSampler:%d" % seed)
            if seed < 0:
                raise ValueError("negative seed")
            return ({"seed": seed},)

    class PSave:
        @classmethod
        def INPUT_TYPES(cls):
            return {"required": {"latent": ("PLATENT",), "prefix": ("STRING", {"default": "p"})}}
        RETURN_TYPES = ()
        FUNCTION = "save"
        OUTPUT_NODE = True
        def save(self, latent, prefix):
            CALLS.append("PSave:" + prefix)
            return {"ui": {"saved": [prefix]}}

    class PSaveId(PSave):
        @classmethod
        def INPUT_TYPES(cls):
            return {"required": {"latent": ("PLATENT",), "prefix": ("STRING", {"default": "p"})},
                    "hidden": {"uid": "UNIQUE_ID"}}
        def save(self, latent, prefix, uid=None):
            CALLS.append("PSaveId:" + str(uid))
            return {"ui": {"saved": [prefix]}}

    class PChanging:
        @classmethod
        def INPUT_TYPES(cls):
            return {"required": {"model": ("PMODEL",), "k": ("INT", {"default": 0})}}
        RETURN_TYPES = ("PLATENT",)
        FUNCTION = "run"
        @classmethod
        def IS_CHANGED(cls, **inputs):
            answer = MODE["answer"]
            if answer == "raise":
                raise RuntimeError("cannot tell")
            return {"const": "same", "fresh_nan": float("nan"), "same_nan": SAME_NAN,
                    "math_nan": math.nan, "object": object(), "list": [1, "a"],
                    "none": None}[answer]
        def run(self, model, k):
            CALLS.append("PChanging:%d" % k)
            return ({"k": k},)

    NODES = {c.__name__: c for c in (PLoader, PSampler, PSave, PSaveId, PChanging)}
''')


def _chain(seed=1, name="a", prefix="p", save="PSave"):
    return {"1": node("PLoader", name=name), "2": node("PSampler", model=["1", 0], seed=seed),
            "3": node(save, latent=["2", 0], prefix=prefix)}


def _changing():
    return {"1": node("PLoader", name="z"), "2": node("PChanging", model=["1", 0], k=5),
            "3": node("PSave", latent=["2", 0], prefix="p")}


def _renumbered(workflow, old, new):
    workflow = copy.deepcopy(workflow)
    workflow[new] = workflow.pop(old)
    return workflow


def _duplicates():
    return {"1": node("PLoader", name="d"), "2": node("PLoader", name="d"),
            "3": node("PSampler", model=["1", 0], seed=1),
            "4": node("PSampler", model=["2", 0], seed=1),
            "5": node("PSave", latent=["3", 0], prefix="a"),
            "6": node("PSave", latent=["4", 0], prefix="b")}


# (IS_CHANGED answer, prompt, the nodes ComfyUI 0.3.64 ran (sorted)), one after the other
PARITY = [
    ("const", _chain(), ["PLoader:a", "PSampler:1", "PSave:p"]),
    ("const", _chain(), []),  # an unchanged prompt: nothing, not even the output node
    ("const", _chain(seed=2), ["PSampler:2", "PSave:p"]),
    ("const", _chain(seed=2, prefix="q"), ["PSave:q"]),
    ("const", _chain(seed=2, name="b"), ["PLoader:b", "PSampler:2", "PSave:p"]),
    ("const", _chain(seed=-1, name="c"), ["PLoader:c", "PSampler:-1"]),  # fails
    ("const", _chain(seed=3, name="c"), ["PSampler:3", "PSave:p"]),
    ("const", _chain(seed=3, name="c", save="PSaveId"), ["PSaveId:3"]),
    ("const", _chain(seed=3, name="c", save="PSaveId"), []),
    ("const", _renumbered(_chain(seed=3, name="c", save="PSaveId"), "3", "9"), ["PSaveId:9"]),
    ("const", _changing(), ["PChanging:5", "PLoader:z", "PSave:p"]),
    ("const", _changing(), []),
    ("fresh_nan", _changing(), ["PChanging:5", "PSave:p"]),
    ("fresh_nan", _changing(), ["PChanging:5", "PSave:p"]),
    ("same_nan", _changing(), ["PChanging:5", "PSave:p"]),
    ("same_nan", _changing(), []),
    ("math_nan", _changing(), ["PChanging:5", "PSave:p"]),
    ("math_nan", _changing(), []),
    ("raise", _changing(), ["PChanging:5", "PSave:p"]),
    ("raise", _changing(), ["PChanging:5", "PSave:p"]),
    ("object", _changing(), ["PChanging:5", "PSave:p"]),
    ("object", _changing(), ["PChanging:5", "PSave:p"]),
    ("list", _changing(), ["PChanging:5", "PSave:p"]),
    ("list", _changing(), []),
    ("none", _changing(), ["PChanging:5", "PSave:p"]),
    ("none", _changing(), []),
    ("const", _duplicates(), ["PLoader:d", "PSampler:1", "PSave:a", "PSave:b"]),
    ("const", _chain(seed=3, name="c"), ["PLoader:c", "PSampler:3", "PSave:p"]),
]


def test_parity_scenarios():
    fakes: dict = {}
    exec(PARITY_NODES, fakes)
    registry = fakes["NODES"]
    cache = NodeCache()
    ran = []
    for answer, prompt, _ in PARITY:
        fakes["MODE"]["answer"] = answer
        fakes["CALLS"].clear()
        try:
            run_workflow(prompt, registry, cache=cache)
        except RunError:
            pass
        ran.append(sorted(fakes["CALLS"]))
    assert ran == [expected for _, _, expected in PARITY]


COMFYUI_DRIVER = textwrap.dedent('''
    import json, sys
    sys.argv = ["driver", "--cpu"]
    sys.path.insert(0, COMFY)
    import comfy.options
    comfy.options.enable_args_parsing()
    import nodes, execution
    fakes = {}
    exec(PARITY_NODES, fakes)
    nodes.NODE_CLASS_MAPPINGS.update(fakes["NODES"])

    class Server:
        client_id = None
        last_node_id = None
        def send_sync(self, *args, **kwargs):
            pass

    executor = execution.PromptExecutor(Server())
    ran = []
    for number, (answer, prompt) in enumerate(json.loads(PROMPTS)):
        fakes["MODE"]["answer"] = answer
        fakes["CALLS"].clear()
        outputs = sorted((k for k, v in prompt.items()
                          if getattr(fakes["NODES"][v["class_type"]], "OUTPUT_NODE", False)),
                         key=int)
        executor.execute(prompt, str(number), {}, outputs)
        ran.append(sorted(fakes["CALLS"]))
    print("RAN " + json.dumps(ran))
''')


def test_parity_scenarios_in_comfyui(tmp_path):
    """The table above, run through ComfyUI's own PromptExecutor (its classic cache)."""
    home = Path(os.environ.get("COMFYUI_HOME", "/nonexistent"))
    comfy, python = home / "ComfyUI", home / "venv" / "bin" / "python"
    if not (comfy / "execution.py").is_file() or not python.is_file():
        pytest.skip("no ComfyUI host (set COMFYUI_HOME; see tools/comfyui_host.sh)")
    script = tmp_path / "driver.py"
    prompts = json.dumps([[answer, prompt] for answer, prompt, _ in PARITY])
    script.write_text(f"COMFY = {str(comfy)!r}\nPARITY_NODES = {PARITY_NODES!r}\n"
                      f"PROMPTS = {prompts!r}\n" + COMFYUI_DRIVER)
    done = subprocess.run([str(python), str(script)], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RAN ")]
    assert lines, done.stdout[-3000:] + done.stderr[-3000:]
    assert json.loads(lines[-1][4:]) == [expected for _, _, expected in PARITY]


# -- real tiny models --------------------------------------------------------------------------

def test_the_speed_preview_with_a_new_seed_reruns_only_sampler_decode_and_save(ti2v_models,
                                                                                tmp_path):
    from tiny_sets import DIT, TE, VAE
    from wan_enhanced.runner.headless_nodes import local_registry

    workflow = json.loads((Path(__file__).resolve().parent.parent / "api_workflows" /
                           "wan22_ti2v_5b_speed_preview.json").read_text())
    workflow["1"]["inputs"].update(model_name=DIT, weight_dtype="fp32")
    workflow["2"]["inputs"].update(text_encoder_name=TE, dtype="fp32", device="cpu")
    workflow["3"]["inputs"].update(vae_name=VAE, dtype="fp32")
    workflow["5"]["inputs"].update(width=64, height=64, frames=5)
    workflow["6"]["inputs"].update(steps=1)
    workflow["8"]["inputs"].update(filename_prefix="cache")
    registry = dict(local_registry())
    models_seen = []

    class Sampler(registry["WanEnhancedSampler"]):
        def run(self, model, *args, **kwargs):
            models_seen.append(model)
            return super().run(model, *args, **kwargs)

    registry["WanEnhancedSampler"] = Sampler
    host.set_headless_folders(models=ti2v_models, output=tmp_path / "out")
    try:
        cache = NodeCache()
        cold = execute(validate(workflow, registry), registry, cache=cache)
        events = []
        workflow["6"]["inputs"]["seed"] += 1
        warm = execute(validate(workflow, registry), registry, cache=cache,
                       on_event=events.append)
        again = []
        same = execute(validate(workflow, registry), registry, cache=cache,
                       on_event=again.append)
    finally:
        host.set_headless_folders(models="models", output="output")
    assert sorted(e.node_id for e in events if e.kind == "cached") == ["1", "2", "3", "4", "5"]
    assert [e.node_id for e in events if e.kind == "finish"] == ["6", "7", "8"]
    assert {k for k, v in warm.node_seconds.items() if v > 0} == {"6", "7", "8"}
    assert models_seen[1] is models_seen[0] is cache.lookup("1").outputs[0]
    assert len(cold.files) == len(warm.files) == 1 and cold.files != warm.files
    assert all(Path(f).is_file() for f in cold.files + warm.files)
    assert [e.kind for e in again] == ["cached"] * 8 and same.files == warm.files
