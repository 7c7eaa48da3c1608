"""The memory probe: a pass-through on any type that records a labelled memory event."""

from __future__ import annotations

from .. import host
from ..safe_paths import UnsafePathError, name_problem, path_inside
from ..profiling.events import LOG_FOLDER
from .checks import output_file_problem, verdict
from .common import ANY, CATEGORY, node_errors


class WanMemoryProbe:
    DISPLAY = "Wan Memory Probe"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "value": (ANY, {"tooltip": "any value: passed on unchanged"}),
            "label": ("STRING", {"default": "probe"}),
        }, "optional": {
            "save_log": ("STRING", {"default": "", "tooltip": "when set, the run's event log is "
                                    "written to this .json file name in the output folder "
                                    "(subfolders allowed; never outside it)"}),
            "write_report": ("BOOLEAN", {"default": False, "tooltip": "also write a Markdown "
                                         "memory report with plots next to the event log (the "
                                         "log goes to save_log, or to wan_memory/RUN_ID.json in "
                                         "the output folder)"}),
        }, "hidden": {"unique_id": "UNIQUE_ID"}}

    RETURN_TYPES = (ANY,)  # fits every input, in ComfyUI's editor and in /prompt
    RETURN_NAMES = ("value",)
    FUNCTION = "probe"
    CATEGORY = CATEGORY
    OUTPUT_NODE = True

    @classmethod
    def VALIDATE_INPUTS(cls, input_types=None, save_log=None, write_report=None):
        # input_types: any type passes through "value"
        if save_log:
            problem = save_log_problem(save_log)
            return verdict([f"save_log: {problem}" if problem else
                            output_file_problem("save_log", save_log)])
        if write_report:
            return verdict([output_file_problem("write_report", f"{LOG_FOLDER}/log.json")])
        return True

    @classmethod
    def IS_CHANGED(cls, save_log="", write_report=False, **_):
        """A probe that writes the run's log runs in every run (a new NaN), and so do the nodes
        after it; a probe that only records is cached like any node (it records when its input
        is computed again), so the nodes after it stay cached too."""
        return float("nan") if save_log or write_report else ""

    def probe(self, value, label, save_log="", write_report=False, unique_id=None):
        from ..profiling.events import current_log, default_log_path

        log = current_log()
        event = log.record(label, stage="probe", node=str(unique_id or ""))
        ui = {"memory_events": [event]}
        if save_log or write_report:
            with node_errors(self.DISPLAY):
                path = (log_path(save_log) if save_log else default_log_path(log.run["id"]))
                log.save(path)
            ui["memory_log"] = [host.hide_server_paths(str(path))]
        if write_report:
            from ..profiling.report import build_report

            ui["memory_report"] = [host.hide_server_paths(str(build_report(path, path.parent)))]
        return {"ui": ui, "result": (value,)}


def save_log_problem(save_log) -> str | None:
    """Why `save_log` cannot name the event log (judged from the text), or None."""
    if save_log in ("", None):
        return None
    problem = name_problem(save_log)
    if problem is None and not save_log.lower().endswith(".json"):
        problem = f"{save_log!r}: the event log is JSON; give a name ending in .json"
    return problem


def log_path(save_log: str):
    """The event log's path in the output folder; refused when it would lead outside it."""
    problem = save_log_problem(save_log)
    if problem is not None:
        raise UnsafePathError(f"save_log: {problem}")
    return path_inside(host.output_directory(), save_log, "save_log")
