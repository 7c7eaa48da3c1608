"""`--set NODE.INPUT=VALUE`: change constant inputs of a workflow from the command line.

NODE is a node id, a class_type or a `_meta.title` (case-insensitive when nothing matches
exactly); a class_type or title shared by several nodes is an error that lists them. INPUT is
split off at the last dot, so titles may contain dots ("Wan 2.2 sampler.steps"). VALUE is parsed
by the input's declared type: INT, FLOAT, BOOLEAN (true/false), STRING (taken as written), a
combo (one of its choices; any text where the node checks that input itself, as a loader does,
which takes a path outside the listing just as in the workflow's JSON); an input of type "*"
takes JSON when VALUE parses as JSON, otherwise the text. Setting an input that is currently
linked replaces the link with the value. Ranges (min/max) are left to validation, which reports
every problem at once.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from typing import Any, Mapping

from .workflow import (ANY_TYPE, CONSTANT_TYPES, Registry, describe_choices, describe_type,
                       input_spec, node_title, validate_inputs_parameters)


class OverrideError(ValueError):
    """A --set (or sweep key) that does not fit the workflow; the message says what exists."""


@dataclass(frozen=True)
class Target:
    node_id: str
    input_name: str
    input_type: Any
    node_checks: bool = False  # the node's VALIDATE_INPUTS checks it (ComfyUI's choices do not)

    def __str__(self) -> str:
        return f"{self.node_id}.{self.input_name}"


def parse_assignment(text: str) -> tuple[str, str]:
    """"NODE.INPUT=VALUE" -> ("NODE.INPUT", "VALUE")."""
    path, sep, value = text.partition("=")
    if not sep or "." not in path.strip(".") or not path.strip():
        raise OverrideError(f"--set {text!r}: expected NODE.INPUT=VALUE, e.g. "
                            "--set 3.steps=20 or --set WanEnhancedSampler.seed=7")
    return path.strip(), value


def apply_overrides(workflow: Mapping, assignments: list[str], registry: Registry) -> dict:
    """A copy of the workflow with every "NODE.INPUT=VALUE" applied (the input is untouched)."""
    result = copy.deepcopy(dict(workflow))
    for text in assignments:
        path, raw = parse_assignment(text)
        target = resolve_path(result, path, registry)
        try:
            value = parse_value(target.input_type, raw, target.node_checks)
        except OverrideError as exc:
            raise OverrideError(f"--set {text!r}: {exc}") from None
        set_input(result, target, value)
    return result


def set_input(workflow: dict, target: Target, value: Any) -> None:
    workflow[target.node_id].setdefault("inputs", {})[target.input_name] = value


def resolve_path(workflow: Mapping, path: str, registry: Registry) -> Target:
    """"NODE.INPUT" -> the node id and the input's declared type."""
    node_ref, _, input_name = path.rpartition(".")
    if not node_ref or not input_name:
        raise OverrideError(f"{path!r}: expected NODE.INPUT (a node id, class_type or title, a "
                            "dot, and the input's name)")
    node_id = resolve_node(workflow, node_ref)
    return resolve_input(workflow, node_id, input_name, registry)


def resolve_node(workflow: Mapping, ref: str) -> str:
    if ref in workflow:
        return ref
    for exact in (True, False):
        found = [node_id for node_id, node in workflow.items()
                 if isinstance(node, Mapping) and _matches(node, ref, exact)]
        if len(found) == 1:
            return found[0]
        if len(found) > 1:
            raise OverrideError(f"{ref!r} matches several nodes: "
                                f"{', '.join(_describe(workflow, n) for n in found)}; use the "
                                "node id (or give the nodes distinct titles)")
    listing = ", ".join(_describe(workflow, n) for n in workflow) or "none"
    raise OverrideError(f"no node {ref!r} in the workflow (by id, class_type or title); its "
                        f"nodes: {listing}")


def resolve_input(workflow: Mapping, node_id: str, input_name: str,
                  registry: Registry) -> Target:
    node = workflow[node_id]
    class_type = node.get("class_type")
    cls = registry.get(class_type) if isinstance(class_type, str) else None
    if cls is None:
        raise OverrideError(f"node {_describe(workflow, node_id)} is of an unknown node type, so "
                            f"the type of {input_name!r} is unknown")
    declared = cls.INPUT_TYPES()
    specs = {**(declared.get("required") or {}), **(declared.get("optional") or {})}
    if input_name not in specs:
        raise OverrideError(f"node {_describe(workflow, node_id)} has no input {input_name!r}; "
                            f"its inputs: {', '.join(specs) or 'none'}")
    input_type, _ = input_spec(specs[input_name])
    if isinstance(input_type, str) and input_type not in CONSTANT_TYPES + (ANY_TYPE,):
        raise OverrideError(f"input {input_name!r} of node {_describe(workflow, node_id)} takes "
                            f"a link ({input_type}), not a value")
    names, takes_all = validate_inputs_parameters(getattr(cls, "VALIDATE_INPUTS", None))
    return Target(node_id, input_name, input_type, takes_all or input_name in names)


def parse_value(input_type: Any, raw: Any, node_checks: bool = False) -> Any:
    """A value for an input of `input_type`, from command-line text (or a JSON value from a
    sweep file, which is kept when it already has a fitting type). `node_checks`: the node's
    own VALIDATE_INPUTS judges the input, so a combo takes text outside its choices (validation
    decides, as for the same value in the workflow)."""
    if isinstance(input_type, (list, tuple)):
        return _combo_member(input_type, raw, node_checks)
    if not isinstance(raw, str):
        return raw  # typed JSON from a sweep file: validation checks it
    if input_type == "STRING":
        return raw
    if input_type == ANY_TYPE:
        try:
            return json.loads(raw)
        except json.JSONDecodeError:
            return raw
    text = raw.strip()
    if input_type == "INT":
        try:
            return int(text)
        except ValueError:
            raise OverrideError(f"expected {describe_type('INT')}, got {raw!r}") from None
    if input_type == "FLOAT":
        try:
            return float(text)
        except ValueError:
            raise OverrideError(f"expected {describe_type('FLOAT')}, got {raw!r}") from None
    if input_type == "BOOLEAN":
        if text.lower() in ("true", "false"):
            return text.lower() == "true"
        raise OverrideError(f"expected true or false, got {raw!r}")
    raise OverrideError(f"cannot set an input of type {input_type}")


def _combo_member(choices, raw: Any, node_checks: bool = False) -> Any:
    if raw in choices:
        return raw
    if isinstance(raw, str):  # numeric combos ([8, 16, 32]) given as text
        for choice in choices:
            if not isinstance(choice, str) and str(choice) == raw.strip():
                return choice
        if node_checks:
            return raw
    raise OverrideError(f"{raw!r} is not one of the choices: {describe_choices(choices)}")


def _matches(node: Mapping, ref: str, exact: bool) -> bool:
    names = [node.get("class_type"), node_title(node)]
    if exact:
        return ref in names
    return any(isinstance(n, str) and n.casefold() == ref.casefold() for n in names)


def _describe(workflow: Mapping, node_id: str) -> str:
    node = workflow.get(node_id)
    if not isinstance(node, Mapping):
        return str(node_id)
    title = node_title(node)
    return f"{node_id} ({node.get('class_type')}" + (f' "{title}")' if title else ")")
