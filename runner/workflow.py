"""API-format workflows: loading and validation against a node registry.

Validation follows what ComfyUI's POST /prompt checks (execution.validate_prompt), but collects
every problem before anything runs instead of stopping at the first one:

- every node names a known class_type, and at least one node is an output node;
- for each node that leads to an output node: required inputs are present; links are
  [node_id, output_index] pairs pointing to an existing node and output; the linked output's type
  fits the input's type as the ComfyUI the registry describes decides it (types_compatible:
  equal, or "A,B" alternatives sharing one, an any-type whose != says False fits all; and by
  release, graph_types.LinkRule: "*" and MatchType fit anything, a list of options a COMBO);
  constants convert to the
  declared INT/FLOAT/STRING/BOOLEAN and lie within min/max, combo values are one of the choices
  (inputs named as VALIDATE_INPUTS parameters skip those checks, as in ComfyUI); VALIDATE_INPUTS
  accepts the constants;
- the needed nodes form no cycle;
- across this package's nodes, what the files the loaders name decide before any model loads
  (graph_checks.py: a VAE that does not fit the model, a size off the model's stride).

Where ComfyUI is silently lenient this module is stricter, because a wrong value in a batch job
should fail before hours of GPU time, not produce a surprising video: BOOLEAN accepts true/false
(not any truthy string), INT refuses 2.5 (ComfyUI truncates), FLOAT refuses NaN and infinity
(NaN passes every min/max comparison), and an input of a wire type such as
LATENT must be a link. Inputs a node does not declare are ignored with a warning, as ComfyUI
ignores them.
"""

from __future__ import annotations

import copy
import difflib
import inspect
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from .graph_types import (ANY_TYPE, COMBO_TYPE, CURRENT_LINKS, MATCH_TYPE, Issue, LinkRule,
                          Registry, WorkflowError, is_link, link_rule_of, node_title)

CONSTANT_TYPES = ("INT", "FLOAT", "STRING", "BOOLEAN")


# -- loading ---------------------------------------------------------------------------------

def load_workflow(path: str | Path, registry: dict | None = None) -> dict:
    """Read an API-format workflow file. A UI-format file (the one File > Save writes) is
    converted when every node is in `registry`; otherwise it is refused with a message saying
    how to get the API format."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise WorkflowError([Issue(f"cannot read the file: {exc.strerror or exc}")],
                            str(path)) from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise WorkflowError([Issue(f"not valid JSON: {exc.msg} at line {exc.lineno}, "
                                   f"column {exc.colno}")], str(path)) from None
    if registry is not None and _is_ui_format(data) and all(
            n.get("type") in registry for n in data["nodes"]):
        from .ui_format import ui_to_api
        return ui_to_api(data, registry, str(path))
    return as_api_workflow(data, str(path))


def _is_ui_format(data: Any) -> bool:
    return isinstance(data, dict) and isinstance(data.get("nodes"), list) and "links" in data


def as_api_workflow(data: Any, source: str | None = None) -> dict:
    """Check the outer shape of workflow JSON and return the {node_id: node} mapping."""
    if _is_ui_format(data):
        raise WorkflowError([Issue(
            "this is a UI-format workflow (it has \"nodes\" and \"links\"); the runner needs the "
            "API format: in ComfyUI use File > Export (API) (older menus: enable dev mode "
            "options in the settings, then Save (API Format))")], source)
    # The body of a POST /prompt request wraps the workflow in "prompt".
    if isinstance(data, dict) and isinstance(data.get("prompt"), dict) and \
            all(isinstance(v, dict) and "class_type" in v for v in data["prompt"].values()):
        data = data["prompt"]
    if not isinstance(data, dict):
        raise WorkflowError([Issue('expected a JSON object {node_id: {"class_type": ..., '
                                   f'"inputs": {{...}}}}}}, got {_json_kind(data)}')], source)
    return data


# -- validation ------------------------------------------------------------------------------

@dataclass
class ValidatedWorkflow:
    """A workflow that passed validation: constants converted to their declared types, links
    normalised to [str node_id, int index], and the nodes to run in dependency order."""

    nodes: dict[str, dict]
    output_nodes: list[str]
    order: list[str]
    warnings: list[Issue] = field(default_factory=list)


def validate(workflow: Mapping, registry: Registry, source: str | None = None) \
        -> ValidatedWorkflow:
    """Check a workflow against the registry; raise WorkflowError listing every problem."""
    workflow = as_api_workflow(workflow, source)
    nodes = copy.deepcopy(dict(workflow))  # conversions are written here, never into the input
    errors: list[Issue] = []
    warnings: list[Issue] = []

    known = _check_nodes(nodes, registry, errors)
    outputs = sorted((nid for nid in known if getattr(registry[nodes[nid]["class_type"]],
                                                      "OUTPUT_NODE", False) is True),
                     key=_id_sort_key)
    if not outputs:
        errors.append(Issue("the workflow has no output node (a node with OUTPUT_NODE = True, "
                            "such as a save node), so nothing would run"))

    # Links are normalised first so the graph walk and the type checks see clean [id, index].
    for node_id in known:
        _normalise_links(node_id, nodes, errors)
    needed = _needed_nodes(outputs, nodes) if outputs else set(known)
    for node_id in sorted(needed & known, key=_id_sort_key):
        _check_inputs(node_id, nodes, registry, errors, warnings)

    order = _dependency_order(outputs, nodes, known, errors)
    if not errors:  # what only the files the loaders name can tell (graph_checks.py)
        from .graph_checks import check_graph
        errors += check_graph(nodes, registry, order)
    if errors:
        raise WorkflowError(errors, source)
    return ValidatedWorkflow(nodes=nodes, output_nodes=outputs, order=order, warnings=warnings)


def _check_nodes(nodes: dict, registry: Registry, errors: list[Issue]) -> set[str]:
    """Node entries well formed and of known classes; returns the ids whose class is known."""
    known = set()
    for node_id in sorted(nodes, key=_id_sort_key):
        node = nodes[node_id]
        if not isinstance(node, dict):
            errors.append(Issue("expected an object with \"class_type\" and \"inputs\", got "
                                f"{_json_kind(node)}", node_id))
            continue
        class_type = node.get("class_type")
        title = node_title(node)
        if not isinstance(class_type, str) or not class_type:
            errors.append(Issue("has no \"class_type\" (every node needs the name of its node "
                                "class)", node_id, title=title))
            continue
        if class_type not in registry:
            hint = _did_you_mean(class_type, registry)
            errors.append(Issue(f'unknown node type "{class_type}"' + (
                hint or "; is the node pack that provides it installed?"),
                node_id, class_type, title))
            continue
        inputs = node.setdefault("inputs", {})
        if not isinstance(inputs, dict):
            errors.append(Issue(f'"inputs" must be an object, got {_json_kind(inputs)}',
                                node_id, class_type, title))
            continue
        known.add(node_id)
    return known


_BAD_LINK = object()


def _normalise_links(node_id: str, nodes: dict, errors: list[Issue]) -> None:
    """[3, 0] and ["3", 0] both mean output 0 of node "3"; malformed links are reported."""
    node = nodes[node_id]
    for name, value in node["inputs"].items():
        if isinstance(value, dict) and "__value__" in value:  # a list-valued constant
            continue
        if not is_link(value):
            continue
        ok = (len(value) == 2 and isinstance(value[0], (str, int)) and
              not isinstance(value[0], bool) and isinstance(value[1], int) and
              not isinstance(value[1], bool) and value[1] >= 0)
        if not ok:
            errors.append(_issue(nodes, node_id, name,
                                 f"bad link {json.dumps(value)}: expected [node_id, "
                                 "output_index]"))
            node["inputs"][name] = _BAD_LINK  # keeps later checks away from it
            continue
        node["inputs"][name] = [str(value[0]), value[1]]


def _needed_nodes(outputs: list[str], nodes: dict) -> set[str]:
    """Every node an output node depends on, through links (only these run and are checked)."""
    seen: set[str] = set()
    stack = list(outputs)
    while stack:
        node_id = stack.pop()
        if node_id in seen or not isinstance(nodes.get(node_id), dict):
            continue
        seen.add(node_id)
        inputs = nodes[node_id].get("inputs")
        if isinstance(inputs, dict):
            stack += [v[0] for v in inputs.values() if is_link(v) and v[0] in nodes]
    return seen


def _check_inputs(node_id: str, nodes: dict, registry: Registry,
                  errors: list[Issue], warnings: list[Issue]) -> None:
    node = nodes[node_id]
    cls = registry[node["class_type"]]
    try:
        declared = cls.INPUT_TYPES()
    except Exception as exc:  # a broken node class must not hide the other problems
        errors.append(_issue(nodes, node_id, None,
                             f"INPUT_TYPES() raised {type(exc).__name__}: {exc}"))
        return
    required = dict(declared.get("required") or {})
    optional = dict(declared.get("optional") or {})
    hidden = dict(declared.get("hidden") or {})
    validator = getattr(cls, "VALIDATE_INPUTS", None)
    custom_names, custom_takes_all = validate_inputs_parameters(validator)
    inputs = node["inputs"]
    node_errors_before = len(errors)
    received_types: dict[str, Any] = {}

    for name, spec in list(required.items()) + list(optional.items()):
        input_type, options = input_spec(spec)
        if name not in inputs:
            if name in required:
                errors.append(_issue(nodes, node_id, name, "required input is missing "
                                     f"(expected {describe_type(input_type)})"))
            continue
        value = inputs[name]
        if value is _BAD_LINK:
            continue  # already reported
        if is_link(value):
            # a link is checked against the declared type itself (a V3 combo's is "COMBO")
            declared_type = spec[0] if isinstance(spec, (tuple, list)) and spec else spec
            received = _check_link(nodes, registry, node_id, name, value, declared_type,
                                   "input_types" in custom_names, errors)
            if received is not None:
                received_types[name] = received
            continue
        if isinstance(value, dict) and "__value__" in value:
            value = inputs[name] = value["__value__"]
        skip_range = name in custom_names or custom_takes_all
        problem, converted = check_constant(input_type, options, value, skip_range)
        if problem:
            errors.append(_issue(nodes, node_id, name, problem))
        else:
            inputs[name] = converted

    for name in inputs:
        if name not in required and name not in optional and name not in hidden:
            listed = ", ".join(list(required) + list(optional)) or "none"
            warnings.append(_issue(nodes, node_id, name,
                                   f"not an input of this node, ignored (its inputs: {listed})"))

    if validator is not None and (custom_names or custom_takes_all) and \
            len(errors) == node_errors_before:
        _run_custom_validation(nodes, node_id, validator, custom_names, custom_takes_all,
                               required, optional, received_types, errors)


def _check_link(nodes: dict, registry: Registry, node_id: str, name: str, link: list,
                input_type: Any, skip_type_check: bool, errors: list[Issue]) -> Any:
    """Report a link to a missing node, output or mismatched type; return the linked type."""
    source_id, index = link
    source = nodes.get(source_id)
    if not isinstance(source, dict):
        errors.append(_issue(nodes, node_id, name,
                             f"linked to node {source_id}, which is not in the workflow"))
        return None
    source_class = registry.get(source.get("class_type")) if isinstance(
        source.get("class_type"), str) else None
    if source_class is None:
        return None  # the source's own error is reported on the source
    returns = tuple(getattr(source_class, "RETURN_TYPES", ()))
    source_label = f"node {source_id} ({source['class_type']})"
    if index >= len(returns):
        have = (f"only {len(returns)} output{'s' if len(returns) != 1 else ''} "
                f"({', '.join(map(str, returns))})" if returns else "no outputs")
        errors.append(_issue(nodes, node_id, name,
                             f"linked to output {index} of {source_label}, which has {have}"))
        return None
    received = returns[index]
    if not skip_type_check and not types_compatible(received, input_type,
                                                    link_rule_of(registry)):
        errors.append(_issue(nodes, node_id, name,
                             f"linked to output {index} of {source_label}, which is "
                             f"{_wire_name(received)}; expected {_wire_name(input_type)}"))
    return received


def types_compatible(received: Any, expected: Any, rule: LinkRule = CURRENT_LINKS) -> bool:
    """ComfyUI's rule (validate_node_input in comfy_execution/validation.py): types that are
    not unequal (`!=`, so that an any-type str whose != answers False, nodes/common.py AnyType,
    fits everything, on either side), or comma-separated alternatives that share one type;
    and what `rule` adds for the release (graph_types.LinkRule). Under LEGACY_LINKS a plain "*"
    is an ordinary type: it fits only "*"."""
    if not received != expected:
        return True
    if rule.any_star and ANY_TYPE in (received, expected):
        return True
    if rule.match_type and MATCH_TYPE in (received, expected):
        return True
    if rule.any_star and isinstance(received, list) and expected == COMBO_TYPE:
        return True
    if not isinstance(received, str) or not isinstance(expected, str):
        return False
    have = {t.strip() for t in received.split(",")}
    want = {t.strip() for t in expected.split(",")}
    if rule.any_star and ANY_TYPE in have | want:
        return True
    return bool(have & want)


def check_constant(input_type: Any, options: Mapping, value: Any,
                   skip_range: bool = False) -> tuple[str | None, Any]:
    """(problem, converted value) for a constant given to an input of `input_type`."""
    if isinstance(input_type, (list, tuple)):
        if skip_range or value in input_type:
            return None, value
        return f"{_show(value)} is not one of the choices: {describe_choices(input_type)}", value
    if input_type == ANY_TYPE:
        return None, value
    if input_type not in CONSTANT_TYPES:
        return (f"expected a link to an output of type {input_type}, got the constant "
                f"{_show(value)}"), value
    converted = _convert(input_type, value)
    if converted is _INVALID:
        return f"expected {describe_type(input_type)}, got {_show(value)}", value
    if input_type == "FLOAT" and not math.isfinite(converted):
        # NaN passes every min/max comparison, and no node means to get it (or infinity)
        return f"expected a finite number, got {_show(value)}", value
    if not skip_range and input_type in ("INT", "FLOAT"):
        low, high = options.get("min"), options.get("max")
        if low is not None and converted < low:
            return f"value {converted} is smaller than the minimum {low}", value
        if high is not None and converted > high:
            return f"value {converted} is bigger than the maximum {high}", value
    return None, converted


_INVALID = object()


def _convert(input_type: str, value: Any) -> Any:
    """Convert a JSON constant to INT/FLOAT/STRING/BOOLEAN, or return _INVALID."""
    if input_type == "STRING":
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)  # ComfyUI converts with str()
        return _INVALID
    if input_type == "BOOLEAN":
        if isinstance(value, bool):
            return value
        if isinstance(value, int) and value in (0, 1):
            return bool(value)
        if isinstance(value, str) and value.strip().lower() in ("true", "false"):
            return value.strip().lower() == "true"
        return _INVALID
    if isinstance(value, bool) or value is None or isinstance(value, (list, dict)):
        return _INVALID
    if input_type == "INT":
        if isinstance(value, int):
            return value
        if isinstance(value, str):
            try:
                return int(value.strip())
            except ValueError:
                try:
                    value = float(value)
                except ValueError:
                    return _INVALID
        if isinstance(value, float) and value.is_integer():
            return int(value)
        return _INVALID
    try:  # FLOAT
        return float(value)
    except (TypeError, ValueError):
        return _INVALID


def _run_custom_validation(nodes: dict, node_id: str, validator, names: list[str],
                           takes_all: bool, required: dict, optional: dict,
                           received_types: dict, errors: list[Issue]) -> None:
    """Call VALIDATE_INPUTS as ComfyUI does: constants by name, linked inputs as None (their
    values do not exist yet), `input_types` with the linked types."""
    inputs = nodes[node_id]["inputs"]
    arguments = {}
    for name in list(required) + list(optional):
        if name in inputs and (takes_all or name in names):
            arguments[name] = None if is_link(inputs[name]) else inputs[name]
    if "input_types" in names:
        arguments["input_types"] = received_types
    try:
        verdict = validator(**arguments)
    except Exception as exc:
        errors.append(_issue(nodes, node_id, None,
                             f"VALIDATE_INPUTS raised {type(exc).__name__}: {exc}"))
        return
    if verdict is not True:
        errors.extend(_verdict_issues(nodes, node_id, verdict, list(required) + list(optional)))


def _verdict_issues(nodes: dict, node_id: str, verdict, names: list[str]) -> list[Issue]:
    """Issues from a VALIDATE_INPUTS answer: a line "input: problem" is located at that input
    (this package's nodes answer one such line per problem); anything else is the node's."""
    if verdict is False or verdict is None or not str(verdict).strip():
        return [_issue(nodes, node_id, None, "VALIDATE_INPUTS rejected the inputs")]
    issues = []
    for line in str(verdict).splitlines():
        name, colon, problem = line.partition(": ")
        if colon and name in names:
            issues.append(_issue(nodes, node_id, name, problem))
        elif line.strip():
            issues.append(_issue(nodes, node_id, None,
                                 f"VALIDATE_INPUTS rejected the inputs: {line}"))
    return issues


def _dependency_order(outputs: list[str], nodes: dict, known: set[str],
                      errors: list[Issue]) -> list[str]:
    """Needed nodes, each after the nodes it reads from; one output's branch at a time (depth
    first, inputs in their written order), so its intermediates can be dropped early."""
    order: list[str] = []
    state: dict[str, str] = {}  # "active" while on the path, "done" once placed
    for output in outputs:
        if state.get(output) == "done":
            continue
        path: list[tuple[str, list[str]]] = [(output, _sources(nodes, output, known))]
        state[output] = "active"
        while path:
            node_id, pending = path[-1]
            if not pending:
                path.pop()
                state[node_id] = "done"
                order.append(node_id)
                continue
            source = pending.pop(0)
            if state.get(source) == "done":
                continue
            if state.get(source) == "active":
                cycle = [n for n, _ in path][[n for n, _ in path].index(source):] + [source]
                errors.append(Issue("dependency cycle: " + " -> ".join(
                    _label(nodes, n) for n in cycle), cycle[0], nodes[cycle[0]]["class_type"],
                    node_title(nodes[cycle[0]])))
                return []
            state[source] = "active"
            path.append((source, _sources(nodes, source, known)))
    return order


def _sources(nodes: dict, node_id: str, known: set[str]) -> list[str]:
    """Nodes this node reads from (links to missing or unknown nodes are reported elsewhere)."""
    return [v[0] for v in nodes[node_id]["inputs"].values() if is_link(v) and v[0] in known]


# -- small helpers ---------------------------------------------------------------------------

def input_spec(spec: Any) -> tuple[Any, Mapping]:
    """(type, options) of an INPUT_TYPES entry; ("INT",) and ("INT", {...}) both occur."""
    input_type, options = spec, {}
    if isinstance(spec, (tuple, list)) and spec:
        input_type = spec[0]
        options = spec[1] if len(spec) > 1 and isinstance(spec[1], Mapping) else {}
    if input_type == "COMBO":  # newer ComfyUI spells a combo ("COMBO", {"options": [...]})
        input_type = list(options.get("options", []))
    return input_type, options


def validate_inputs_parameters(function) -> tuple[list[str], bool]:
    """Named parameters of VALIDATE_INPUTS and whether it takes **kwargs."""
    if function is None:
        return [], False
    try:
        spec = inspect.getfullargspec(function)
    except TypeError:
        return [], False
    names = [a for a in spec.args if a not in ("self", "cls", "s")]
    return names, spec.varkw is not None


def describe_type(input_type: Any) -> str:
    if isinstance(input_type, (list, tuple)):
        return "one of " + describe_choices(input_type)
    return {"INT": "an integer (INT)", "FLOAT": "a number (FLOAT)", "STRING": "text (STRING)",
            "BOOLEAN": "true or false (BOOLEAN)", ANY_TYPE: "any value (*)"}.get(
        input_type, str(input_type))


def _wire_name(input_type: Any) -> str:
    return input_type if isinstance(input_type, str) else describe_type(input_type)


def describe_choices(options) -> str:
    shown = ", ".join(_show(o) for o in list(options)[:20])
    more = f", ... ({len(options)} choices)" if len(options) > 20 else ""
    return f"[{shown}{more}]" if options else "[] (no choices available)"


def _show(value: Any) -> str:
    text = json.dumps(value) if _jsonable(value) else repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _jsonable(value: Any) -> bool:
    try:
        json.dumps(value)
        return True
    except (TypeError, ValueError):
        return False


def _json_kind(value: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean",
            type(None): "null"}.get(type(value), "a number")


def _did_you_mean(name: str, registry: Registry) -> str:
    close = difflib.get_close_matches(name, list(registry), n=3, cutoff=0.6)
    return f"; did you mean {', '.join(close)}?" if close else ""


def _issue(nodes: dict, node_id: str, input_name: str | None, message: str) -> Issue:
    node = nodes[node_id]
    return Issue(message, node_id, node.get("class_type"), node_title(node), input_name)


def _label(nodes: dict, node_id: str) -> str:
    return f"{node_id} ({nodes[node_id]['class_type']})"


def _id_sort_key(node_id: str):
    """Numeric ids in numeric order ("2" before "10"), others after, alphabetically."""
    text = str(node_id)
    return (0, int(text), "") if text.isdigit() else (1, 0, text)
