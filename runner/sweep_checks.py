"""Every job of a sweep checked before the first one runs, without validating every job.

A sweep key is *independent* when nothing but ComfyUI's own check of that one input judges it:
its node's VALIDATE_INPUTS does not name it (nor takes **kwargs), it is not an any-type input
(whose value could read as a link), and it is not an input of a node the cross-node checks read
(graph_checks.READ_CLASSES). A seed or a prompt is independent; a width or a model file is not.

Then a job is valid exactly when each of its independent values passes that input's check and
its dependent values, with each independent key at a value that passes, form a valid workflow.
So a sweep is checked with one constant check per independent value and one whole validation
per combination of dependent values: a sweep of 10^5 seeds costs 10^5 constant checks and one
validation, where validating every job costs 10^5 validations.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

from .executor import check_supported
from .graph_checks import READ_CLASSES
from .graph_types import Issue, Registry, WorkflowError, node_title
from .sweep import Sweep, SweepJob
from .workflow import (ANY_TYPE, ValidatedWorkflow, check_constant, input_spec, validate,
                       validate_inputs_parameters)


@dataclass
class SweepVerdict:
    invalid: int = 0  # how many jobs are invalid
    # the first job with each problem, and the problems it is the first to have
    reports: list[tuple[SweepJob, list[str]]] = field(default_factory=list)
    first: ValidatedWorkflow | None = None  # a valid job, for its warnings


def check_job(job: SweepJob, registry: Registry, source: str | None) -> ValidatedWorkflow:
    """The job's workflow validated and its node features supported (raises WorkflowError)."""
    validated = validate(job.workflow, registry, source=source)
    check_supported(validated, registry)
    return validated


def check_sweep(sweep: Sweep, registry: Registry, source: str | None = None) -> SweepVerdict:
    keys = list(sweep.values)
    free = [key for key in keys if is_independent(sweep, key, registry)]
    bound = [key for key in keys if key not in free]

    bad: dict[str, dict[int, str]] = {key: _value_problems(sweep, key, registry) for key in free}
    chosen = {key: next((i for i in range(len(sweep.values[key])) if i not in bad[key]), 0)
              for key in free}

    verdict = SweepVerdict()
    found: list[tuple[int, list[str]]] = []  # (job index, problems)
    bound_ok = 0
    for picks in itertools.product(*(range(len(sweep.values[key])) for key in bound)):
        at = {**chosen, **dict(zip(bound, picks))}
        index = sweep.job_index(at)
        try:
            validated = check_job(sweep[index], registry, source)
        except WorkflowError as exc:
            found.append((index, [str(issue) for issue in exc.errors]))
            continue
        bound_ok += 1
        if verdict.first is None:
            verdict.first = validated
    if verdict.first is not None:  # a key on a node no output needs is not checked (as ComfyUI)
        bad = {key: (problems if sweep.targets[key].node_id in verdict.first.order else {})
               for key, problems in bad.items()}
    for key in free:
        for value_at, problem in bad[key].items():
            found.append((sweep.job_index({**chosen, key: value_at, **{k: 0 for k in bound}}),
                          [problem]))

    valid = bound_ok * math.prod(len(sweep.values[key]) - len(bad[key]) for key in free)
    verdict.invalid = len(sweep) - valid
    seen: set[str] = set()
    for index, problems in sorted(found, key=lambda item: item[0]):
        fresh = [p for p in problems if p not in seen]
        seen.update(fresh)
        if fresh:
            verdict.reports.append((sweep[index], fresh))
    return verdict


def is_independent(sweep: Sweep, key: str, registry: Registry) -> bool:
    target = sweep.targets[key]
    class_type = sweep.workflow[target.node_id].get("class_type")
    names, takes_all = validate_inputs_parameters(
        getattr(registry.get(class_type), "VALIDATE_INPUTS", None))
    return not (takes_all or target.input_name in names or target.input_type == ANY_TYPE or
                class_type in READ_CLASSES)


def _value_problems(sweep: Sweep, key: str, registry: Registry) -> dict[int, str]:
    """{position of a value: its problem} for an independent key, as validation words it."""
    target = sweep.targets[key]
    node = sweep.workflow[target.node_id]
    declared = registry[node["class_type"]].INPUT_TYPES()
    spec = {**(declared.get("required") or {}), **(declared.get("optional") or {})}
    input_type, options = input_spec(spec[target.input_name])
    problems = {}
    for at, value in enumerate(sweep.values[key]):
        if isinstance(value, dict) and "__value__" in value:
            value = value["__value__"]
        problem, _ = check_constant(input_type, options, value)
        if problem:
            problems[at] = str(Issue(problem, target.node_id, node.get("class_type"),
                                     node_title(node), target.input_name))
    return problems
