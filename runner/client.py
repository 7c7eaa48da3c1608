"""A client for a running ComfyUI server: queue an API-format workflow, follow it, fetch results.

One run: open the websocket /ws?clientId=... first (so no message is missed), POST /prompt, read
messages until `executing` with node null for our prompt_id, GET /history/{prompt_id}, then
download every file the outputs' ui dicts list through GET /view. /history is also polled every
few seconds, so a lost websocket only slows the run down.

A run is a failure unless the server ran the whole workflow: a POST answer that lists
`node_errors` (ComfyUI then queues only the outputs that passed validation; the client takes the
prompt off the queue again) and a run in which none of the workflow's output nodes produced an
output are reported with the server's messages, like a refused prompt or a node that failed.

Ctrl-C, `kill` (SIGTERM) or a hangup (SIGHUP) removes the prompt from the queue and interrupts it on
the server (POST /queue, POST /interrupt). The prompt id is chosen here, so this works from the
moment the prompt is posted; while a run is followed, only the first signal raises: any further one,
however soon after, is counted and cannot cut the cancel requests short. A process that started with
SIGINT ignored (a background job) keeps ignoring it, SIGTERM still stops it (see stop_signals).
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

from ..atomic_files import claim, put_new
from ..safe_paths import UnsafePathError, name_problem, path_inside
from .stop_signals import FirstStopRaises
from .executor import EventCallback, RunEvent, ui_file_entries
from .graph_types import NodeRegistry, link_rule_for
from .workflow import Issue, node_title

LOOPBACK = ("localhost", "127.0.0.1", "::1")
CANCEL_TIMEOUT_S = 10.0  # each of the two cancel requests


class ServerError(RuntimeError):
    """The server could not be reached or answered something unexpected."""


class PromptRejected(ServerError):
    """POST /prompt answered 400: ComfyUI's validation failed; `errors` lists its node errors."""

    def __init__(self, error: Mapping, node_errors: Mapping, workflow: Mapping):
        self.error, self.node_errors = dict(error or {}), dict(node_errors or {})
        self.errors = _node_issues(self.node_errors, workflow)
        self.prompt_id: str | None = None  # set when the server had queued a part of it
        headline = self.error.get("message") or "invalid prompt"
        details = self.error.get("details")
        lines = [f"ComfyUI rejected the workflow: {headline}"]
        if self.errors:
            lines += [f"  - {issue}" for issue in self.errors]
        elif details:
            lines += [f"  - {details}"]
        super().__init__("\n".join(lines))


class RemoteRunError(ServerError):
    """A node failed on the server (websocket execution_error, or the history says so)."""

    def __init__(self, prompt_id: str, data: Mapping):
        self.prompt_id = prompt_id
        self.node_id = data.get("node_id")
        self.node_type = data.get("node_type")
        self.exception_type = data.get("exception_type") or "error"
        self.exception_message = str(data.get("exception_message") or "").strip()
        self.traceback = "".join(data.get("traceback") or [])
        super().__init__(f"node {self.node_id} ({self.node_type}) failed on the server: "
                         f"{self.exception_type}: {self.exception_message}")


class MissingOutputs(RemoteRunError):
    """The server reports the prompt done, but none of the workflow's output nodes produced an
    output."""

    def __init__(self, prompt_id: str, expected: list[str], workflow: Mapping):
        self.prompt_id, self.expected = prompt_id, expected
        self.node_id = self.node_type = None
        self.exception_type, self.traceback = "missing outputs", ""
        labels = ", ".join(f"{n} ({(workflow.get(n) or {}).get('class_type', '?')})"
                           for n in expected)
        self.exception_message = (f"prompt {prompt_id} finished, but none of the workflow's "
                                  f"output nodes produced an output: {labels}")
        ServerError.__init__(self, self.exception_message)


class RemoteInterrupted(ServerError):
    """The prompt was interrupted (by us on Ctrl-C, or by someone else)."""

    def __init__(self, prompt_id: str, message: str):
        self.prompt_id = prompt_id
        super().__init__(message)


@dataclass
class ServerRunResult:
    prompt_id: str
    outputs: dict[str, dict]  # node id -> ui dict, from /history
    files: list[str]  # downloaded paths
    seconds: float
    status: str


class Client:
    def __init__(self, url: str, *, client_id: str | None = None, timeout: float = 30.0,
                 poll_seconds: float = 5.0, log: Callable[[str], None] | None = None):
        if "://" not in url:
            url = "http://" + url
        self.base = url.rstrip("/")
        self.client_id = client_id or str(uuid.uuid4())
        self.timeout, self.poll_seconds = timeout, poll_seconds
        self.log = log or (lambda message: None)
        host = urllib.parse.urlsplit(self.base).hostname or ""
        # A local server is never reached through an HTTP proxy from the environment.
        handlers = [urllib.request.ProxyHandler({})] if host in LOOPBACK else []
        self._opener = urllib.request.build_opener(*handlers)
        self._object_info: dict | None = None
        # the prompt run() follows, and whether cancel_in_flight was called (from another
        # thread): both change under _flight, so a stop either finds the prompt or comes first
        self.in_flight: str | None = None
        self.stopped = False
        self._flight = threading.Lock()

    # -- HTTP ----------------------------------------------------------------------------------

    def object_info(self) -> dict:
        """The server's node classes (read once per client)."""
        if self._object_info is None:
            self._object_info = self._json("GET", "/object_info")
        return self._object_info

    def _check_outputs(self, prompt_id: str, workflow: Mapping, outputs: Mapping) -> None:
        """Raise MissingOutputs when the workflow has output nodes and none of them produced
        an output; name in the log those that produced none while others did."""
        try:
            info = self.object_info()
        except ServerError as exc:
            self.log(f"warning: cannot check the outputs ({exc})")
            return
        expected = sorted((node_id for node_id, node in workflow.items()
                           if isinstance(node, Mapping) and isinstance(
                               info.get(node.get("class_type")), Mapping)
                           and info[node["class_type"]].get("output_node")), key=str)
        if expected and not set(expected) & set(outputs):
            raise MissingOutputs(prompt_id, expected, workflow)
        for node_id in expected:
            if node_id not in outputs:
                self.log(f"warning: output node {node_id} "
                         f"({workflow[node_id].get('class_type')}) produced no output")

    def comfyui_version(self) -> str | None:
        """The server's ComfyUI release (/system_stats), or None where it does not say."""
        try:
            stats = self._json("GET", "/system_stats")
        except ServerError:
            return None
        system = stats.get("system") if isinstance(stats, Mapping) else None
        version = system.get("comfyui_version") if isinstance(system, Mapping) else None
        return version if isinstance(version, str) else None

    def registry(self) -> NodeRegistry:
        """Stand-in node classes built from /object_info: enough to type --set values and
        resolve sweep keys for nodes this process does not have; links are checked by the
        rule of the server's release."""
        classes = {name: _stand_in(name, info) for name, info in self.object_info().items()
                   if isinstance(info, Mapping)}
        return NodeRegistry(classes, link_rule_for(self.comfyui_version()))

    def submit(self, workflow: Mapping, extra_data: Mapping | None = None,
               prompt_id: str | None = None) -> str:
        """Queue the workflow under `prompt_id` (made here when not given). Raises
        PromptRejected when the server refuses it, or queues only part of it (node_errors in a
        200 answer: that part is taken off the queue again)."""
        prompt_id = prompt_id or str(uuid.uuid4())
        body = {"prompt": workflow, "client_id": self.client_id, "prompt_id": prompt_id}
        if extra_data:
            body["extra_data"] = dict(extra_data)
        status, reply = self._call("POST", "/prompt", body)
        if status == 400:
            reply = reply if isinstance(reply, Mapping) else {}
            raise PromptRejected(reply.get("error") or {}, reply.get("node_errors") or {},
                                 workflow)
        if status != 200 or not isinstance(reply, Mapping) or "prompt_id" not in reply:
            raise ServerError(f"POST /prompt on {self.base} answered {status}: "
                              f"{_short(reply)}")
        prompt_id = str(reply["prompt_id"])
        if reply.get("node_errors"):
            self.cancel(prompt_id)
            rejected = PromptRejected({"message": "some of the workflow's outputs failed "
                                                  "validation (the server queued only the "
                                                  "others; the prompt was taken off its queue)"},
                                      reply["node_errors"], workflow)
            rejected.prompt_id = prompt_id
            raise rejected
        return prompt_id

    def history(self, prompt_id: str) -> dict | None:
        """The finished prompt's entry, or None while it is queued or running."""
        reply = self._json("GET", f"/history/{urllib.parse.quote(prompt_id)}")
        entry = reply.get(prompt_id) if isinstance(reply, Mapping) else None
        return entry if isinstance(entry, dict) else None

    def cancel(self, prompt_id: str) -> None:
        """Remove the prompt if it is still queued, and stop it if it is running (both are sent
        whatever the first answers; a prompt the server does not know is left alone)."""
        for method, path, body in (("POST", "/queue", {"delete": [prompt_id]}),
                                   ("POST", "/interrupt", {"prompt_id": prompt_id})):
            try:
                self._call(method, path, body, timeout=min(self.timeout, CANCEL_TIMEOUT_S))
            except ServerError as exc:
                self.log(f"warning: {exc}")

    def cancel_in_flight(self) -> str | None:
        """cancel() the prompt that run() is following, from another thread (the several-server
        runner's main thread on Ctrl-C or SIGTERM): that prompt only, not whatever else the
        server runs or has queued. Its id, or None when no run is in flight. From then on run()
        posts nothing; a prompt being posted meanwhile is cancelled again by its run once it is
        posted (the server may have queued it after this cancel), and a run that waits for one
        (queued, so never to finish now) stops waiting."""
        with self._flight:
            self.stopped = True
            prompt_id = self.in_flight
        if prompt_id is not None:
            self.cancel(prompt_id)
        return prompt_id

    def download_outputs(self, outputs: Mapping[str, Mapping], out_dir: str | Path) -> list[Path]:
        return [self.download(entry, out_dir) for entry in ui_file_entries(outputs)]

    def download(self, entry: Mapping, out_dir: str | Path) -> Path:
        """GET /view into out_dir/subfolder/filename ("temp"/"input" files under out_dir/type)."""
        target = download_path(entry, out_dir)
        query = urllib.parse.urlencode({k: entry[k] for k in ("filename", "subfolder", "type")})
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_name(target.name + ".part")
        try:
            with self._opener.open(f"{self.base}/view?{query}", timeout=self.timeout) as reply, \
                    open(partial, "wb") as f:
                while chunk := reply.read(1 << 20):
                    f.write(chunk)
        except urllib.error.HTTPError as exc:
            partial.unlink(missing_ok=True)
            raise ServerError(f"GET /view for {entry['filename']!r} answered {exc.code}") from None
        except (urllib.error.URLError, OSError) as exc:
            partial.unlink(missing_ok=True)
            raise ServerError(f"downloading {entry['filename']!r} from {self.base} failed: "
                              f"{getattr(exc, 'reason', exc)}") from None
        except KeyboardInterrupt:  # Ctrl-C or SIGTERM: no .part file left behind
            partial.unlink(missing_ok=True)
            raise
        try:
            return place_new(partial, target)
        finally:
            partial.unlink(missing_ok=True)

    def _json(self, method: str, path: str, body: Any = None) -> Any:
        status, reply = self._call(method, path, body)
        if status != 200:
            raise ServerError(f"{method} {path} on {self.base} answered {status}: {_short(reply)}")
        return reply

    def _call(self, method: str, path: str, body: Any = None,
              timeout: float | None = None) -> tuple[int, Any]:
        data = json.dumps(body).encode("utf-8") if body is not None else None
        request = urllib.request.Request(self.base + path, data=data, method=method,
                                         headers={"Content-Type": "application/json"})
        try:
            with self._opener.open(request, timeout=timeout or self.timeout) as reply:
                return reply.status, _decode(reply.read())
        except urllib.error.HTTPError as exc:
            return exc.code, _decode(exc.read())
        except (urllib.error.URLError, OSError) as exc:
            raise ServerError(f"cannot reach ComfyUI at {self.base}: "
                              f"{getattr(exc, 'reason', exc)}") from None

    # -- one run -------------------------------------------------------------------------------

    def run(self, workflow: Mapping, out_dir: str | Path,
            on_event: EventCallback | None = None) -> ServerRunResult:
        """Queue the workflow, wait for it, download its files. Raises PromptRejected,
        RemoteRunError, RemoteInterrupted (also after Ctrl-C or SIGTERM) or ServerError."""
        started = time.perf_counter()
        prompt_id = str(uuid.uuid4())
        with FirstStopRaises():  # takes nothing inside the runner's own (stop_signals)
            ws = self._connect()
            try:
                with self._flight:
                    if self.stopped:
                        raise RemoteInterrupted(prompt_id, "interrupted before the prompt was "
                                                           "posted")
                    self.in_flight = prompt_id
                try:
                    self.submit(workflow, prompt_id=prompt_id)
                    if self.stopped:  # cancel_in_flight came while the prompt was being posted
                        raise self._cancelled(prompt_id)
                    entry = self._wait(ws, prompt_id, _Tracker(workflow, on_event))
                except KeyboardInterrupt:
                    raise self._cancelled(prompt_id) from None
            finally:
                with self._flight:
                    self.in_flight = None
                if ws is not None:
                    _close_quietly(ws)
        _raise_if_failed(prompt_id, entry)
        outputs = {k: v for k, v in (entry.get("outputs") or {}).items() if isinstance(v, dict)}
        self._check_outputs(prompt_id, workflow, outputs)
        files = self.download_outputs(outputs, out_dir)
        status = (entry.get("status") or {}).get("status_str", "success")
        return ServerRunResult(prompt_id, outputs, [str(f) for f in files],
                               time.perf_counter() - started, status)

    def _cancelled(self, prompt_id: str) -> RemoteInterrupted:
        """Cancel prompt_id on the server; the error that says so."""
        self.cancel(prompt_id)
        return self._interrupted(prompt_id)

    def _interrupted(self, prompt_id: str) -> RemoteInterrupted:
        return RemoteInterrupted(prompt_id, f"interrupted: asked {self.base} to stop prompt "
                                            f"{prompt_id}")

    def _connect(self):
        try:
            import websocket
        except ImportError:
            self.log("warning: the websocket-client package is missing; following the prompt "
                     "by polling /history")
            return None
        scheme = "wss" if self.base.startswith("https") else "ws"
        url = f"{scheme}://{self.base.split('://', 1)[1]}/ws?clientId={self.client_id}"
        try:
            ws = websocket.create_connection(url, timeout=self.timeout)
            ws.settimeout(min(1.0, self.poll_seconds))
            return ws
        except (websocket.WebSocketException, OSError) as exc:
            self.log(f"warning: no websocket at {url} ({exc}); following the prompt by polling "
                     "/history")
            return None

    def _wait(self, ws, prompt_id: str, tracker: "_Tracker") -> dict:
        last_poll = time.monotonic()
        while True:
            if self.stopped:  # cancel_in_flight cancelled this prompt (it may never run now)
                raise self._interrupted(prompt_id)
            if ws is not None:
                ws, text = self._receive(ws)
                if text is not None:
                    if tracker.handle(_parse(text), prompt_id):
                        break
                    continue
            else:
                time.sleep(min(0.5, self.poll_seconds))
            if time.monotonic() - last_poll >= self.poll_seconds:
                last_poll = time.monotonic()
                entry = self.history(prompt_id)
                if entry is not None:
                    return entry
        for _ in range(50):  # the history is written just before the final message
            entry = self.history(prompt_id)
            if entry is not None:
                return entry
            time.sleep(0.1)
        raise ServerError(f"prompt {prompt_id} finished but /history has no entry for it")

    def _receive(self, ws):
        """(the websocket, or None once it closed; a text message or None)."""
        import websocket
        try:
            message = ws.recv()
        except websocket.WebSocketTimeoutException:
            return ws, None
        except (websocket.WebSocketException, OSError) as exc:
            self.log(f"warning: the websocket closed ({exc or type(exc).__name__}); following "
                     "the prompt by polling /history")
            _close_quietly(ws)
            return None, None
        if not getattr(ws, "connected", True):  # the server sent a close frame
            self.log("warning: the server closed the websocket; following the prompt by "
                     "polling /history")
            _close_quietly(ws)
            return None, None
        if isinstance(message, bytes) or not message:  # preview images, control frames
            return ws, None
        return ws, message


class _Tracker:
    """Turns websocket messages into RunEvents; raises on execution_error/interrupted."""

    def __init__(self, workflow: Mapping, on_event: EventCallback | None):
        self.workflow, self.on_event = workflow, on_event
        self.started: dict[str, float] = {}
        self.current: str | None = None

    def handle(self, message: Mapping, prompt_id: str) -> bool:
        """True once the prompt is complete."""
        kind, data = message.get("type"), message.get("data") or {}
        if not isinstance(data, Mapping) or data.get("prompt_id", prompt_id) != prompt_id:
            return False  # another prompt's message (or status, which has no prompt_id)
        if kind == "executing":
            node = data.get("node")
            if node is None:
                return True
            self._finish_current()
            self.current = str(node)
            self.started[self.current] = time.perf_counter()
            self._emit("start", self.current)
        elif kind == "progress" and data.get("node") is not None:
            self._emit("progress", str(data["node"]), value=int(data.get("value", 0)),
                       total=int(data.get("max", 0)))
        elif kind == "executed" and data.get("node") is not None:
            if str(data["node"]) == self.current:
                self._finish_current()
        elif kind == "execution_cached":
            for node in data.get("nodes") or []:
                self._emit("cached", str(node))
        elif kind == "execution_error":
            raise RemoteRunError(prompt_id, data)
        elif kind == "execution_interrupted":
            raise RemoteInterrupted(prompt_id, f"prompt {prompt_id} was interrupted on the "
                                               f"server at node {data.get('node_id')} "
                                               f"({data.get('node_type')})")
        return False

    def _finish_current(self) -> None:
        if self.current is not None:
            self._emit("finish", self.current)
            self.current = None

    def _emit(self, kind: str, node_id: str, **extra) -> None:
        if self.on_event is None:
            return
        node = self.workflow.get(node_id)
        node = node if isinstance(node, Mapping) else {}
        started = self.started.get(node_id)
        seconds = time.perf_counter() - started if started is not None else 0.0
        index = list(self.started).index(node_id) + 1 if node_id in self.started else 0
        self.on_event(RunEvent(kind, node_id, str(node.get("class_type", "?")), node_title(node),
                               index, 0, seconds=seconds, **extra))


def _raise_if_failed(prompt_id: str, entry: Mapping) -> None:
    """A history entry whose status says error: raise what its messages say."""
    status = entry.get("status") or {}
    if status.get("status_str") != "error":
        return
    for item in status.get("messages") or []:
        if isinstance(item, list) and len(item) == 2 and isinstance(item[1], Mapping):
            if item[0] == "execution_error":
                raise RemoteRunError(prompt_id, item[1])
            if item[0] == "execution_interrupted":
                raise RemoteInterrupted(prompt_id, f"prompt {prompt_id} was interrupted")
    raise RemoteRunError(prompt_id, {"exception_message": "the server reports an error"})


def _node_issues(node_errors: Mapping, workflow: Mapping) -> list[Issue]:
    issues = []
    for node_id, info in node_errors.items():
        info = info if isinstance(info, Mapping) else {}
        node = workflow.get(node_id) if isinstance(workflow.get(node_id), Mapping) else {}
        where = (str(node_id), info.get("class_type") or node.get("class_type"), node_title(node))
        seen: set[tuple] = set()
        for error in info.get("errors") or []:
            extra = error.get("extra_info") or {}
            if error.get("type") == "custom_validation_failed":
                found = _verdict_issues(error, node, where)
            else:
                text = error.get("message") or "error"
                if error.get("details"):
                    text += f": {error['details']}"
                found = [Issue(text, *where, extra.get("input_name"))]
            for issue in found:  # ComfyUI repeats a verdict under each input the check names
                if (issue.message, issue.input_name) not in seen:
                    seen.add((issue.message, issue.input_name))
                    issues.append(issue)
    return issues


def _verdict_issues(error: Mapping, node: Mapping, where: tuple) -> list[Issue]:
    """A VALIDATE_INPUTS verdict, which ComfyUI files under every input the check names
    ("details": "INPUT - VERDICT"): each line of this package's verdicts ("input: problem") is
    placed at the input it names; another node's verdict stays where ComfyUI put it."""
    filed_under = (error.get("extra_info") or {}).get("input_name")
    details = str(error.get("details") or "")
    if isinstance(filed_under, str) and details.startswith(filed_under + " - "):
        details = details[len(filed_under) + 3:]
    message = error.get("message") or "Custom validation failed for node"
    inputs = node.get("inputs") if isinstance(node.get("inputs"), Mapping) else {}
    issues = []
    for line in details.splitlines() or [""]:
        named, sep, _ = line.partition(": ")
        input_name = named if sep and named in inputs else filed_under
        issues.append(Issue(f"{message}: {line}" if line else message, *where, input_name))
    return issues


def _stand_in(name: str, info: Mapping) -> type:
    spec = {k: dict(v) for k, v in (info.get("input") or {}).items() if isinstance(v, Mapping)}
    return type(name, (), {
        "INPUT_TYPES": classmethod(lambda cls, spec=spec: spec),
        "RETURN_TYPES": tuple(info.get("output") or ()),
        "OUTPUT_NODE": bool(info.get("output_node")),
        "FUNCTION": "run_on_server",
    })


def _parse(text: str) -> dict:
    try:
        message = json.loads(text)
    except ValueError:
        return {}
    return message if isinstance(message, dict) else {}


def _decode(raw: bytes) -> Any:
    try:
        return json.loads(raw) if raw else None
    except ValueError:
        return raw.decode("utf-8", "replace")


def _short(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value)
    return text if len(text) <= 300 else text[:297] + "..."


def _close_quietly(ws) -> None:
    try:
        ws.close(timeout=1.0)  # the wait for the server's close reply: short, it is a courtesy
    except Exception:
        pass


def place_new(finished: Path, target: Path) -> Path:
    """Move the downloaded `finished` to `target`, or, where a file is there already (a run
    into a folder shared with others, a server whose numbering restarted), to the first free
    `STEM-2.EXT`, `STEM-3.EXT`, ...: a download never replaces a file. Names are claimed
    across processes while the file is moved in."""
    for number in range(1, 10_000):
        candidate = target if number == 1 else \
            target.with_name(f"{target.stem}-{number}{target.suffix}")
        if candidate.exists():
            continue
        claimed = claim(candidate)
        if claimed is None:
            continue
        try:
            put_new(finished, candidate, f"the downloaded {target.name}")
            return candidate
        except FileExistsError:
            continue
        finally:
            claimed.release()
    raise ServerError(f"no free name for {target.name} in {target.parent}")


def download_path(entry: Mapping, out_dir: str | Path) -> Path:
    """Where a server's output file goes: out_dir/subfolder/filename ("temp"/"input" files under
    out_dir/type). Names that would lead outside out_dir (absolute, '..', a link) are refused."""
    kind = str(entry.get("type") or "output")
    parts = ([] if kind == "output" else [kind]) + [str(entry.get("subfolder") or ""),
                                                    str(entry.get("filename") or "")]
    name = "/".join(part.strip("/\\") for part in parts if part.strip("/\\"))
    if not entry.get("filename") or any(name_problem(part) for part in parts if part):
        raise ServerError(f"the server named an output file {dict(entry)!r} that would lead "
                          f"outside the download folder {out_dir}; not downloaded")
    try:
        return path_inside(out_dir, name, "output file", "the download folder")
    except UnsafePathError as error:
        raise ServerError(f"{error}; not downloaded") from None
