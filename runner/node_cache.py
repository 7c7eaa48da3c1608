"""Node outputs kept between in-process runs, reused as ComfyUI's server reuses them.

A `NodeCache` given to `executor.execute(..., cache=...)` (or `run_workflow`) makes a run in this
process behave like a prompt on a ComfyUI server with its default ("classic") cache, as in
ComfyUI 0.3.64 (execution.py, comfy_execution/caching.py):

- Each node of the run gets a signature (`node_signatures`): its class_type, the value of its
  class's IS_CHANGED (False without one), its node id when its class declares the hidden input
  UNIQUE_ID or sets NOT_IDEMPOTENT, and its inputs in name order, a constant as its value and a
  link as (the position of the source node among the node's ancestors, the output index); the
  same for every ancestor, in a fixed order. A node's signature thus changes when anything
  upstream of it changes. Hidden inputs other than UNIQUE_ID (the prompt, extra_pnginfo) are
  not part of it.
- A node whose signature has outputs in the cache does not run: its readers get the very objects
  the cache holds, and its ui dict is the cached one. That includes output nodes (OUTPUT_NODE):
  ComfyUI does not run an unchanged save node again, it answers with the ui of the run that
  made it (so the "files" of such a run name the earlier run's files). A save node that must
  write every time needs a changed input, or an IS_CHANGED that says so.
- Two nodes of one run with the same signature (the same class and inputs from the same
  sources, no UNIQUE_ID) run once: the second takes the first one's outputs, as in ComfyUI.
- IS_CHANGED, where a node class defines it, is called once per node at the start of each run,
  on the class, before any node runs, with the node's constant inputs, None for each linked
  input (their values do not exist yet), and the hidden inputs it declares (UNIQUE_ID: the node
  id; PROMPT: {}; the others None), as ComfyUI calls it. What it returns goes into the signature
  as [value]: an equal value (compared with ==; lists and dicts by their items) reuses the
  outputs, a different one runs the node and everything downstream. NaN compares unequal to
  every other NaN, so `float("nan")`, a new NaN each call, runs the node every time; but Python
  compares an object with itself as equal before it asks ==, so the very same NaN object
  returned again (math.nan, a module constant) reuses the outputs in ComfyUI 0.3.64, and here.
  A value of another type than None, bool, int, float, str, a list/tuple or a dict (any object)
  is never equal to the next run's, and an IS_CHANGED that raises counts as a new NaN (ComfyUI
  logs a warning; so does this module).
- The cache holds the outputs of the last run's nodes only: at the start of each run, before any
  node runs, every entry whose signature is not one of that run's signatures is dropped (ComfyUI
  drops them then too), so memory does not grow across different workflows, nor across
  repeated runs with new seeds (the old sampler output goes as the new run starts).
  Entries are added as each node finishes: a failed or interrupted run leaves the outputs of
  the nodes that finished (the next run reuses them, as ComfyUI does) and nothing of the node
  that failed, so it holds no more than the successful run would have.
- Node instances are reused too (ComfyUI's "objects" cache): one per (node id, class_type),
  kept while the node is in the runs.

Differences from ComfyUI: nodes that no output node needs do not run, and their entries are
dropped like those of nodes not in the workflow (ComfyUI keeps the entries of every node of the
prompt); IS_CHANGED gets only the inputs the node declares (the runner passes only those to the
node); ComfyUI's V3 nodes (fingerprint_inputs) are not run by this runner at all.

This package's nodes: all declare UNIQUE_ID, so they are keyed by node id too (a renumbered
workflow runs them again, in ComfyUI as here); only the memory probe defines IS_CHANGED: a new
NaN when it writes the run's log (save_log / write_report), so it and everything downstream of it
run in every run; otherwise a constant, so it is cached like any node. The
headless LoadImage stand-in (headless_nodes.py) has no IS_CHANGED, unlike ComfyUI's, which
hashes the file: an image replaced under the same name is not read again.

A cache belongs to one registry (a class_type names one class) and to one run at a time.
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Hashable, Mapping, Sequence

import torch

from .graph_types import Registry, is_link

if TYPE_CHECKING:
    from .workflow import ValidatedWorkflow

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CachedNode:
    """What a finished node left: its output values (one per RETURN_TYPES entry, in order) and
    the ui dict it returned (None without one)."""

    outputs: tuple
    ui: Any = None


class NodeCache:
    """The outputs of the nodes of the last in-process run, by node signature (see the module
    docstring). Pass the same instance to every run that should reuse them; `clear()` or
    dropping the instance frees what it holds."""

    def __init__(self) -> None:
        self._entries: dict[Hashable, CachedNode] = {}
        self._objects: dict[tuple[str, str], Any] = {}  # (node id, class_type) -> instance
        self._signatures: dict[str, Hashable] = {}  # node id -> signature, of the current run

    def __len__(self) -> int:
        """How many nodes' outputs are held."""
        return len(self._entries)

    def clear(self) -> None:
        """Forget everything (outputs, node instances, signatures)."""
        self._entries.clear()
        self._objects.clear()
        self._signatures = {}

    # -- used by the executor ------------------------------------------------------------------

    def begin_run(self, validated: "ValidatedWorkflow", registry: Registry) -> None:
        """Compute the run's signatures (calling IS_CHANGED, once per node) and drop every entry
        and node instance the run cannot use. Called before the run's first node."""
        signatures = node_signatures(validated, registry)  # before any change: it may raise
        used = set(signatures.values())
        self._signatures = signatures
        self._entries = {key: entry for key, entry in self._entries.items() if key in used}
        present = {(node_id, validated.nodes[node_id]["class_type"]) for node_id in signatures}
        self._objects = {key: obj for key, obj in self._objects.items() if key in present}

    def lookup(self, node_id: str) -> CachedNode | None:
        """The cached outputs for this node of the current run, or None (it must run)."""
        key = self._signatures.get(node_id)
        return None if key is None else self._entries.get(key)

    def store(self, node_id: str, outputs: tuple, ui: Any = None) -> CachedNode:
        """Keep a finished node's outputs (the very objects) under its signature."""
        entry = CachedNode(tuple(outputs), ui)
        if node_id in self._signatures:
            self._entries[self._signatures[node_id]] = entry
        return entry

    def node_object(self, node_id: str, class_type: str, cls: type) -> Any:
        """The node's instance: the one an earlier run made for this node id and class_type,
        or a new one (kept for the next run)."""
        key = (node_id, class_type)
        obj = self._objects.get(key)
        if type(obj) is not cls:  # none yet, or the class_type now names another class
            obj = self._objects[key] = cls()
        return obj

    # -- for callers and tests -----------------------------------------------------------------

    def signature(self, node_id: str) -> Hashable | None:
        """The node's signature in the current (or last) run, None when it was not in it."""
        return self._signatures.get(node_id)

    def node_ids(self) -> list[str]:
        """The nodes of the current (or last) run whose outputs are held."""
        return [node_id for node_id, key in self._signatures.items() if key in self._entries]


# -- signatures --------------------------------------------------------------------------------

def node_signatures(validated: "ValidatedWorkflow", registry: Registry) -> dict[str, Hashable]:
    """Each node to run (validated.order) -> its signature, as ComfyUI 0.3.64's
    CacheKeySetInputSignature makes it. IS_CHANGED is called once per node that defines it."""
    nodes = validated.nodes
    heads = {}  # node id -> [class_type, IS_CHANGED value(, node id)]
    for node_id in validated.order:
        class_type = nodes[node_id]["class_type"]
        cls = registry[class_type]
        heads[node_id] = [class_type, is_changed_value(node_id, nodes[node_id], cls)]
        if getattr(cls, "NOT_IDEMPOTENT", False) or _declares_unique_id(cls):
            heads[node_id].append(node_id)
    return {node_id: _signature(node_id, nodes, heads) for node_id in validated.order}


def _signature(node_id: str, nodes: Mapping[str, dict], heads: Mapping[str, list]) -> Hashable:
    ancestors, position = _ordered_ancestry(node_id, nodes)
    signature = [_immediate_signature(n, nodes, heads, position) for n in [node_id, *ancestors]]
    return to_hashable(signature)


def _immediate_signature(node_id: str, nodes: Mapping[str, dict], heads: Mapping[str, list],
                         position: Mapping[str, int]) -> list:
    """ComfyUI's get_immediate_node_signature: the head, then each input in name order, a link
    as its source's position among the ancestors of the node being keyed."""
    signature = list(heads[node_id])
    inputs = nodes[node_id]["inputs"]
    for name in sorted(inputs):
        value = inputs[name]
        if is_link(value):
            signature.append((name, ("ANCESTOR", position[value[0]], value[1])))
        else:
            signature.append((name, value))
    return signature


def _ordered_ancestry(node_id: str, nodes: Mapping[str, dict]) -> tuple[list[str], dict]:
    """Every node upstream of node_id, depth first through the inputs in name order, and each
    one's position in that list (ComfyUI's get_ordered_ancestry)."""
    ancestors: list[str] = []
    position: dict[str, int] = {}
    stack = [iter(sorted(nodes[node_id]["inputs"].items()))]
    while stack:
        for _, value in stack[-1]:
            if is_link(value) and value[0] not in position:
                source = value[0]
                ancestors.append(source)
                position[source] = len(ancestors) - 1
                stack.append(iter(sorted(nodes[source]["inputs"].items())))
                break
        else:
            stack.pop()
    return ancestors, position


def _declares_unique_id(cls: type) -> bool:
    hidden = cls.INPUT_TYPES().get("hidden") or {}
    return "UNIQUE_ID" in hidden.values()


def is_changed_value(node_id: str, node: Mapping, cls: type) -> Any:
    """What the node's signature holds for IS_CHANGED: False without one, [its value], or a new
    NaN when it raised (ComfyUI's IsChangedCache.get)."""
    if not hasattr(cls, "IS_CHANGED"):
        return False
    try:
        with torch.inference_mode():
            value = cls.IS_CHANGED(**_is_changed_arguments(node_id, node, cls))
            if inspect.isawaitable(value):
                value = asyncio.run(_awaited(value))
    except Exception as exc:
        log.warning("node %s (%s): IS_CHANGED raised %s: %s; the node runs", node_id,
                    node["class_type"], type(exc).__name__, exc)
        return float("nan")
    return [value]


async def _awaited(awaitable):
    return await awaitable


_HIDDEN_FOR_IS_CHANGED = {"PROMPT": lambda node_id: {}, "DYNPROMPT": lambda node_id: None,
                          "EXTRA_PNGINFO": lambda node_id: None,
                          "UNIQUE_ID": lambda node_id: node_id,
                          "AUTH_TOKEN_COMFY_ORG": lambda node_id: None,
                          "API_KEY_COMFY_ORG": lambda node_id: None}


def _is_changed_arguments(node_id: str, node: Mapping, cls: type) -> dict[str, Any]:
    """The node's declared inputs it was given (a link as None), and its hidden inputs as
    ComfyUI gives them to IS_CHANGED (no prompt: {}; no extra data: None)."""
    declared = cls.INPUT_TYPES()
    names = set(declared.get("required") or {}) | set(declared.get("optional") or {})
    arguments = {name: None if is_link(value) else value
                 for name, value in node["inputs"].items() if name in names}
    for name, kind in (declared.get("hidden") or {}).items():
        if kind in _HIDDEN_FOR_IS_CHANGED:
            arguments[name] = _HIDDEN_FOR_IS_CHANGED[kind](node_id)
    return arguments


class Unhashable:
    """A value a signature cannot compare (ComfyUI's caching.Unhashable): equal only to
    itself, so a signature holding one never matches another run's."""

    def __init__(self) -> None:
        self.value = float("nan")


def to_hashable(obj: Any) -> Hashable:
    """ComfyUI 0.3.64's caching.to_hashable: scalars as they are, mappings and sequences as
    frozensets of their (key or index, item) pairs, anything else Unhashable()."""
    if isinstance(obj, (int, float, str, bool, type(None))):
        return obj
    if isinstance(obj, Mapping):
        return frozenset([(to_hashable(k), to_hashable(v)) for k, v in sorted(obj.items())])
    if isinstance(obj, Sequence):
        return frozenset(zip(itertools.count(), [to_hashable(i) for i in obj]))
    return Unhashable()
