"""The data of a workflow graph shared by its readers and checkers: the node registry, the
problems found in a graph, and how a node's links and title are read (API format)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from ..host import version_numbers

Registry = Mapping[str, type]


# -- which links a ComfyUI accepts -------------------------------------------------------------

ANY_TYPE = "*"
MATCH_TYPE = "COMFY_MATCHTYPE_V3"  # a V3 node's input or output that takes the type it is given
COMBO_TYPE = "COMBO"


@dataclass(frozen=True)
class LinkRule:
    """What ComfyUI's /prompt accepts as a link beyond types that are not unequal or share an
    alternative (comfy_execution/validation.py), by release: MatchType ends fit anything from
    0.4.0; from 0.8.0 a plain "*" (alone or among alternatives) fits anything on either side,
    and a list of options fits a COMBO input."""

    match_type: bool
    any_star: bool


LEGACY_LINKS = LinkRule(match_type=False, any_star=False)  # 0.3.x
CURRENT_LINKS = LinkRule(match_type=True, any_star=True)  # 0.8.0 and later
_LINK_RULES = (((0, 8, 0), CURRENT_LINKS), ((0, 4, 0), LinkRule(match_type=True,
                                                               any_star=False)))


def link_rule_for(version: str | None) -> LinkRule:
    """The link rule of a ComfyUI release ("0.3.64", "v0.30.0"); an unknown version gets the
    newest rule (the server judges the prompt again when it arrives)."""
    numbers = version_numbers(version)
    if numbers is None:
        return CURRENT_LINKS
    return next((rule for since, rule in _LINK_RULES if numbers >= since), LEGACY_LINKS)


class NodeRegistry(dict):
    """A registry of the node classes one ComfyUI serves, with the link rule of its release."""

    def __init__(self, classes: Mapping[str, type], link_rule: LinkRule = CURRENT_LINKS):
        super().__init__(classes)
        self.link_rule = link_rule


def link_rule_of(registry: Registry) -> LinkRule:
    """The registry's link rule; this package's own nodes (a plain mapping) follow today's."""
    return getattr(registry, "link_rule", CURRENT_LINKS)


# -- problems --------------------------------------------------------------------------------

@dataclass(frozen=True)
class Issue:
    """One problem found in a workflow, located as precisely as possible."""

    message: str
    node_id: str | None = None
    class_type: str | None = None
    title: str | None = None
    input_name: str | None = None

    def __str__(self) -> str:
        if self.node_id is None:
            return self.message
        where = f"node {self.node_id}"
        label = " ".join(part for part in (self.class_type,
                                           f'"{self.title}"' if self.title else None) if part)
        if label:
            where += f" ({label})"
        if self.input_name is not None:
            where += f', input "{self.input_name}"'
        return f"{where}: {self.message}"


class WorkflowError(Exception):
    """The workflow cannot run; `errors` lists every problem found."""

    def __init__(self, errors: list[Issue], source: str | None = None):
        self.errors = list(errors)
        self.source = source
        super().__init__(self._text())

    def _text(self) -> str:
        name = f"workflow {self.source}" if self.source else "workflow"
        count = len(self.errors)
        lines = [f"{name} is invalid ({count} error{'s' if count != 1 else ''}):"]
        lines += [f"  - {issue}" for issue in self.errors]
        return "\n".join(lines)


def node_title(node: Mapping) -> str | None:
    meta = node.get("_meta")
    if isinstance(meta, Mapping) and isinstance(meta.get("title"), str) and meta["title"]:
        return meta["title"]
    return None


def is_link(value: Any) -> bool:
    return isinstance(value, list)
