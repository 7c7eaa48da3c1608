"""Converting between ComfyUI's two workflow formats for the nodes of a registry.

UI format (what File > Save writes and example_workflows/ holds): `nodes` with positional
`widgets_values` and `links` as [id, from_node, from_slot, to_node, to_slot, type]. API format
(what /prompt takes): {node_id: {"class_type", "inputs": {name: value | [node_id, slot]}}}.

The widget order is the order of the constant inputs in INPUT_TYPES (required, then optional);
an INT marked `control_after_generate` is followed by one extra widget value ("fixed" etc.), as
the ComfyUI frontend adds it. Reroutes, primitive nodes, groups and bypassed nodes are the
frontend's business: they are refused with a message rather than guessed.
"""

from __future__ import annotations

from typing import Any

from .graph_types import Issue, WorkflowError

WIDGET_TYPES = ("INT", "FLOAT", "STRING", "BOOLEAN")
MUTED, BYPASSED = 2, 4


def _declared(cls) -> list[tuple[str, Any, dict]]:
    """(name, type, options) of every required and optional input, in order."""
    spec = cls.INPUT_TYPES()
    out = []
    for section in ("required", "optional"):
        for name, entry in (spec.get(section) or {}).items():
            kind = entry[0]
            options = entry[1] if len(entry) > 1 and isinstance(entry[1], dict) else {}
            out.append((name, kind, options))
    return out


def _is_widget(kind) -> bool:
    return isinstance(kind, list) or kind in WIDGET_TYPES


def _type_name(kind) -> str:
    return "COMBO" if isinstance(kind, list) else str(kind)


def api_to_ui(workflow: dict, registry: dict) -> dict:
    """A UI-format graph (laid out left to right by dependency depth) for an API workflow."""
    ids = {node_id: int(node_id) for node_id in workflow}
    depth: dict[str, int] = {}

    def level(node_id: str) -> int:
        if node_id not in depth:
            depth[node_id] = 0
            links = [v for v in workflow[node_id]["inputs"].values() if isinstance(v, list)]
            depth[node_id] = 1 + max((level(str(v[0])) for v in links), default=-1)
        return depth[node_id]

    links, nodes = [], []
    outputs_of: dict[str, dict[int, list[int]]] = {}
    rows: dict[int, int] = {}
    for node_id in sorted(workflow, key=lambda n: (level(n), ids[n])):
        node = workflow[node_id]
        cls = registry[node["class_type"]]
        inputs, widgets = [], []
        for name, kind, options in _declared(cls):
            value = node["inputs"].get(name, options.get("default"))
            if _is_widget(kind):
                widgets.append(value)
                if options.get("control_after_generate"):
                    widgets.append("fixed")
                if options.get("image_upload"):
                    widgets.append("image")  # the frontend's upload button saves a value
                continue
            link_id = None
            if isinstance(value, list):
                link_id = len(links) + 1
                source = str(value[0])
                source_type = registry[workflow[source]["class_type"]].RETURN_TYPES[value[1]]
                links.append([link_id, ids[source], value[1], ids[node_id],
                              len(inputs), source_type])
                outputs_of.setdefault(source, {}).setdefault(value[1], []).append(link_id)
            inputs.append({"name": name, "type": _type_name(kind), "link": link_id})
        column = level(node_id)
        row = rows.get(column, 0)
        rows[column] = row + 1
        entry = {"id": ids[node_id], "type": node["class_type"],
                 "pos": [60 + 380 * column, 60 + 260 * row], "size": [340, 200], "flags": {},
                 "order": len(nodes), "mode": 0, "inputs": inputs, "outputs": [],
                 "properties": {"Node name for S&R": node["class_type"]},
                 "widgets_values": widgets}
        title = node.get("_meta", {}).get("title")
        if title:
            entry["title"] = title
        nodes.append(entry)
    for entry in nodes:
        cls = registry[entry["type"]]
        names = getattr(cls, "RETURN_NAMES", None) or cls.RETURN_TYPES
        entry["outputs"] = [
            {"name": names[slot], "type": kind, "slot_index": slot,
             "links": outputs_of.get(str(entry["id"]), {}).get(slot, [])}
            for slot, kind in enumerate(cls.RETURN_TYPES)]
    return {"last_node_id": max(ids.values(), default=0), "last_link_id": len(links),
            "nodes": nodes, "links": links, "groups": [], "config": {}, "extra": {},
            "version": 0.4}


def ui_to_api(graph: dict, registry: dict, source: str | None = None) -> dict:
    """The API form of a UI-format graph whose nodes are all in `registry`."""
    issues: list[Issue] = []
    links = {}
    for link in graph.get("links", []):
        link_id, from_node, from_slot = link[0], link[1], link[2]
        links[link_id] = [str(from_node), from_slot]
    api: dict[str, dict] = {}
    for node in graph.get("nodes", []):
        node_id, class_type = str(node.get("id")), node.get("type")
        if node.get("mode", 0) == MUTED:
            continue
        if node.get("mode", 0) == BYPASSED:
            issues.append(Issue("bypassed nodes are not converted; export the API format from "
                                "ComfyUI instead", node_id, class_type))
            continue
        if class_type not in registry:
            issues.append(Issue(f"node type {class_type!r} is not one of this package's nodes "
                                f"(reroutes and primitives need ComfyUI's own export)",
                                node_id, class_type))
            continue
        values = list(node.get("widgets_values") or [])
        linked = {i["name"]: links.get(i.get("link")) for i in node.get("inputs", [])
                  if i.get("link") is not None}
        inputs: dict[str, Any] = {}
        optional = set(registry[class_type].INPUT_TYPES().get("optional") or {})
        for name, kind, options in _declared(registry[class_type]):
            if name in linked:
                inputs[name] = linked[name]
                if _is_widget(kind) and values:  # a widget turned into an input keeps its slot
                    values.pop(0)
                    if options.get("control_after_generate") and values:
                        values.pop(0)
                continue
            if _is_widget(kind):
                if not values and name in optional:
                    # saved before this optional widget existed: the frontend gives it its default
                    inputs[name] = options.get("default")
                    continue
                if not values:
                    issues.append(Issue("fewer widget values than the node has widgets",
                                        node_id, class_type, input_name=name))
                    break
                inputs[name] = values.pop(0)
                if (options.get("control_after_generate") or options.get("image_upload")) \
                        and values:
                    values.pop(0)
        api[node_id] = {"class_type": class_type, "inputs": inputs}
        if node.get("title"):
            api[node_id]["_meta"] = {"title": node["title"]}
    if issues:
        raise WorkflowError(issues, source)
    return api
