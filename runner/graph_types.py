"""The data of a workflow graph shared by its readers and checkers: the node registry, the
problems found in a graph, and how a node's links and title are read (API format)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

Registry = Mapping[str, type]


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
