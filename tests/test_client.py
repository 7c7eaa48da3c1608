"""The ComfyUI client against a small in-process fake server (HTTP + a minimal websocket) that
replays the message sequence a real ComfyUI sends."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import queue
import select
import signal
import subprocess
import sys
import threading
import time
import urllib.parse
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from wan_enhanced.runner import cli
from wan_enhanced.runner.client import (Client, MissingOutputs, PromptRejected,
                                        RemoteInterrupted, RemoteRunError)

WS_GUID = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11"
VIDEO = b"\x00\x00\x00\x18ftypmp42 not really a video"
PREVIEW = b"\x89PNG preview"

WORKFLOW = {
    "1": {"class_type": "WanEnhancedModelLoader",
          "inputs": {"model": "wan2.2_ti2v_5B.safetensors"}},
    "2": {"class_type": "WanEnhancedSampler", "inputs": {"model": ["1", 0], "seed": 1, "steps": 2},
          "_meta": {"title": "Sampler"}},
    "3": {"class_type": "WanEnhancedSaveVideo", "inputs": {"latent": ["2", 0],
                                                           "filename_prefix": "wan/clip"}},
}

OBJECT_INFO = {
    "WanEnhancedModelLoader": {"input": {"required": {"model": [["wan2.2_ti2v_5B.safetensors"],
                                                                {}]}},
                               "output": ["WANMODEL"], "output_node": False},
    "WanEnhancedSampler": {"input": {"required": {
        "model": ["WANMODEL"], "seed": ["INT", {"default": 0, "min": 0}],
        "steps": ["INT", {"default": 30, "min": 1, "max": 1000}]}},
        "output": ["LATENT"], "output_node": False},
    "WanEnhancedSaveVideo": {"input": {"required": {
        "latent": ["LATENT"], "filename_prefix": ["STRING", {"default": "wan"}],
        "format": ["COMBO", {"options": ["mp4", "webm"]}]}},
        "output": [], "output_node": True},
}

UI_OUTPUT = {"gifs": [{"filename": "clip_00001.mp4", "subfolder": "wan", "type": "output",
                       "format": "video/h264-mp4"}],
             "images": [{"filename": "preview.png", "subfolder": "", "type": "temp"}]}


# -- the fake server ---------------------------------------------------------------------------

class FakeComfyUI:
    """Enough of ComfyUI's server: /prompt, /history/<id>, /view, /interrupt, /queue,
    /object_info and /ws. `scenario` picks what a queued prompt does."""

    def __init__(self, scenario: str, version: str | None = None):
        self.scenario = scenario
        self.version = version  # what /system_stats says (None: no such route)
        self.log: list[tuple] = []  # ("POST", path, body) / ("GET", path) / ("sent", type)
        self.history: dict[str, dict] = {}
        self.sockets: dict[str, queue.Queue] = {}
        self.interrupted = threading.Event()
        self.stopping = threading.Event()
        self.files = {("clip_00001.mp4", "wan", "output"): VIDEO,
                      ("preview.png", "", "temp"): PREVIEW}
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, args=(0.02,), daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stopping.set()
        self.httpd.shutdown()
        self.httpd.server_close()

    def posted(self, path: str) -> list:
        return [entry[2] for entry in self.log if entry[:2] == ("POST", path)]

    # -- a prompt's life ---------------------------------------------------------------------

    def play(self, client_id: str, prompt_id: str) -> None:
        send = self.sockets[client_id].put

        def message(kind, **data):
            if kind != "status":
                data["prompt_id"] = prompt_id
            send(("text", {"type": kind, "data": data}))
            time.sleep(0.01)

        message("status", status={"exec_info": {"queue_remaining": 1}})
        message("execution_start", timestamp=1)
        message("execution_cached", nodes=["1"], timestamp=1)
        send(("text", {"type": "executing", "data": {"node": "9", "prompt_id": "other"}}))
        message("executing", node="2", display_node="2")
        message("progress", value=1, max=2, node="2")
        send(("binary", b"\x00\x00\x00\x01" + PREVIEW))  # a preview frame
        if self.scenario == "drop":
            send(("close", None))
            time.sleep(0.3)
            self.finish(prompt_id, "success")
            return
        if self.scenario == "interrupt":
            self.interrupted.wait(5)
            message("execution_interrupted", node_id="2", node_type="WanEnhancedSampler",
                    executed=["1"])
            self.finish(prompt_id, "error")
            message("executing", node=None)
            return
        if self.scenario == "error":
            error = dict(node_id="2", node_type="WanEnhancedSampler", executed=["1"],
                         exception_message="CUDA out of memory. Tried to allocate 2.00 GiB\n",
                         exception_type="torch.OutOfMemoryError",
                         traceback=['  File "execution.py", line 1\n'], current_inputs={},
                         current_outputs=[])
            message("execution_error", **error)
            self.finish(prompt_id, "error", [["execution_error", error]])
            message("executing", node=None)
            return
        message("progress", value=2, max=2, node="2")
        message("executing", node="3", display_node="3")
        message("executed", node="3", display_node="3", output=UI_OUTPUT)
        message("execution_success", timestamp=2)
        time.sleep(0.2)  # the client must wait, not fetch the history early
        self.finish(prompt_id, "success")
        message("executing", node=None)

    def finish(self, prompt_id: str, status: str, messages=()) -> None:
        outputs = {"3": UI_OUTPUT} if status == "success" and self.scenario != "no-outputs" \
            else {}
        self.history[prompt_id] = {
            "prompt": [0, prompt_id, WORKFLOW, {}, ["3"]], "outputs": outputs,
            "status": {"status_str": status, "completed": status == "success",
                       "messages": list(messages)}, "meta": {}}
        self.log.append(("history written", prompt_id))

    # -- HTTP --------------------------------------------------------------------------------

    def _handler(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def reply(self, status: int, body, content_type="application/json"):
                data = body if isinstance(body, bytes) else json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(data)))
                self.send_header("Connection", "close")
                self.end_headers()
                self.wfile.write(data)
                self.close_connection = True

            def do_GET(self):
                url = urllib.parse.urlsplit(self.path)
                query = dict(urllib.parse.parse_qsl(url.query))
                server.log.append(("GET", url.path))
                if url.path == "/ws":
                    return self.websocket(query["clientId"])
                if url.path.startswith("/history/"):
                    prompt_id = url.path.rsplit("/", 1)[1]
                    entry = server.history.get(prompt_id)
                    return self.reply(200, {prompt_id: entry} if entry else {})
                if url.path == "/view":
                    key = (query.get("filename"), query.get("subfolder", ""), query.get("type"))
                    if key in server.files:
                        return self.reply(200, server.files[key], "application/octet-stream")
                    return self.reply(404, b"", "text/plain")
                if url.path == "/object_info":
                    return self.reply(200, OBJECT_INFO)
                if url.path == "/system_stats" and server.version is not None:
                    return self.reply(200, {"system": {"comfyui_version": server.version}})
                self.reply(404, {"error": "not found"})

            def do_POST(self):
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length) or b"{}")
                server.log.append(("POST", self.path, body))
                if self.path == "/prompt":
                    return self.prompt(body)
                if self.path == "/queue":
                    time.sleep(0.1)  # a server slower than two signals in a row
                if self.path == "/interrupt":
                    server.interrupted.set()
                self.reply(200, {})

            def prompt(self, body):
                if server.scenario == "reject":
                    return self.reply(400, {
                        "error": {"type": "prompt_outputs_failed_validation",
                                  "message": "Prompt outputs failed validation",
                                  "details": "", "extra_info": {}},
                        "node_errors": {"2": {"errors": [{
                            "type": "value_bigger_than_max",
                            "message": "Value 5000 bigger than max of 1000", "details": "steps",
                            "extra_info": {"input_name": "steps", "received_value": 5000}}],
                            "dependent_outputs": ["3"], "class_type": "WanEnhancedSampler"}}})
                prompt_id = str(body.get("prompt_id") or uuid.uuid4())  # as ComfyUI does
                if server.scenario == "partial":  # the outputs that passed are queued
                    return self.reply(200, {"prompt_id": prompt_id, "number": 0, "node_errors": {
                        "3": {"errors": [{
                            "type": "return_type_mismatch",
                            "message": "Return type mismatch between linked nodes",
                            "details": "latent, received_type(*) mismatch input_type(LATENT)",
                            "extra_info": {"input_name": "latent"}}],
                            "dependent_outputs": ["3"],
                            "class_type": "WanEnhancedSaveVideo"}}})
                self.reply(200, {"prompt_id": prompt_id, "number": 0, "node_errors": {}})
                threading.Thread(target=server.play, args=(body["client_id"], prompt_id),
                                 daemon=True).start()

            def websocket(self, client_id: str):
                # the outbox exists before the handshake's answer, so a prompt the client
                # posts right after it always finds it
                outbox = server.sockets.setdefault(client_id, queue.Queue())
                key = self.headers["Sec-WebSocket-Key"]
                accept = base64.b64encode(hashlib.sha1((key + WS_GUID).encode()).digest())
                self.send_response(101, "Switching Protocols")
                self.send_header("Upgrade", "websocket")
                self.send_header("Connection", "Upgrade")
                self.send_header("Sec-WebSocket-Accept", accept.decode())
                self.end_headers()
                self.wfile.flush()
                try:
                    self.serve_websocket(client_id, outbox)
                except ConnectionError:  # the client hung up first (a cancelled run): no error
                    pass
                self.close_connection = True

            def serve_websocket(self, client_id: str, outbox: queue.Queue):
                self.frame(1, json.dumps({"type": "status", "data": {
                    "status": {"exec_info": {"queue_remaining": 0}}, "sid": client_id}}).encode())
                while not server.stopping.is_set():
                    readable, _, _ = select.select([self.connection], [], [], 0)
                    if readable:  # the client's close frame: answer it and hang up
                        self.frame(8, b"\x03\xe8")
                        break
                    try:
                        kind, payload = outbox.get(timeout=0.02)
                    except queue.Empty:
                        continue
                    if kind == "close":
                        self.frame(8, b"\x03\xe8")
                        break
                    if kind == "text":
                        server.log.append(("sent", payload["type"], payload["data"].get("node")))
                        self.frame(1, json.dumps(payload).encode())
                    else:
                        self.frame(2, payload)

            def frame(self, opcode: int, payload: bytes):
                """An unmasked, unfragmented server frame (RFC 6455 section 5.2)."""
                size = len(payload)
                if size < 126:
                    header = bytes([0x80 | opcode, size])
                elif size < 1 << 16:
                    header = bytes([0x80 | opcode, 126]) + size.to_bytes(2, "big")
                else:
                    header = bytes([0x80 | opcode, 127]) + size.to_bytes(8, "big")
                self.wfile.write(header + payload)
                self.wfile.flush()

        return Handler


# -- tests -------------------------------------------------------------------------------------

class SignalComfyUI(FakeComfyUI):
    """Successful runs; as the first prompt starts, `signum` reaches this process, the client's:
    SIGINT as Ctrl-C sends it, or SIGTERM as `kill` does."""

    def __init__(self, signum: int = signal.SIGINT):
        super().__init__("success")
        self.signum = signum
        self.pressed = threading.Event()

    def play(self, client_id: str, prompt_id: str) -> None:
        if not self.pressed.is_set():
            self.pressed.set()
            os.kill(os.getpid(), self.signum)
            time.sleep(0.1)
        super().play(client_id, prompt_id)


def test_run_waits_for_completion_and_downloads_every_output(tmp_path):
    events = []
    with FakeComfyUI("success") as server:
        client = Client(server.url)
        result = client.run(WORKFLOW, tmp_path / "out", on_event=events.append)
    assert result.status == "success" and result.outputs == {"3": UI_OUTPUT}
    assert result.files == [str(tmp_path / "out" / "wan" / "clip_00001.mp4"),
                            str(tmp_path / "out" / "temp" / "preview.png")]
    assert (tmp_path / "out" / "wan" / "clip_00001.mp4").read_bytes() == VIDEO
    assert (tmp_path / "out" / "temp" / "preview.png").read_bytes() == PREVIEW
    # the history was read only after the final "executing null" message
    final = server.log.index(("sent", "executing", None))
    history_reads = [i for i, entry in enumerate(server.log)
                     if entry[0] == "GET" and entry[1].startswith("/history/")]
    assert history_reads and min(history_reads) > final
    body = server.posted("/prompt")[0]
    assert body["prompt"] == WORKFLOW and str(uuid.UUID(body["client_id"])) == body["client_id"]
    assert [(e.kind, e.node_id) for e in events] == [
        ("cached", "1"), ("start", "2"), ("progress", "2"), ("progress", "2"), ("finish", "2"),
        ("start", "3"), ("finish", "3")]
    assert events[1].name == "Sampler" and (events[3].value, events[3].total) == (2, 2)


def test_rejected_prompt_reports_node_errors_readably(tmp_path):
    with FakeComfyUI("reject") as server:
        with pytest.raises(PromptRejected) as excinfo:
            Client(server.url).run(WORKFLOW, tmp_path)
    assert str(excinfo.value) == (
        "ComfyUI rejected the workflow: Prompt outputs failed validation\n"
        '  - node 2 (WanEnhancedSampler "Sampler"), input "steps": Value 5000 bigger than max '
        "of 1000: steps")


def test_execution_error_names_the_node(tmp_path):
    with FakeComfyUI("error") as server:
        with pytest.raises(RemoteRunError) as excinfo:
            Client(server.url).run(WORKFLOW, tmp_path)
    error = excinfo.value
    assert str(error) == ("node 2 (WanEnhancedSampler) failed on the server: "
                          "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB")
    assert "execution.py" in error.traceback
    assert not list(tmp_path.iterdir())


def test_ctrl_c_interrupts_the_prompt_on_the_server(tmp_path):
    def press_ctrl_c(event):
        if event.kind == "progress":
            raise KeyboardInterrupt

    with FakeComfyUI("interrupt") as server:
        with pytest.raises(RemoteInterrupted) as excinfo:
            Client(server.url).run(WORKFLOW, tmp_path, on_event=press_ctrl_c)
        prompt_id = excinfo.value.prompt_id
        assert server.posted("/interrupt") == [{"prompt_id": prompt_id}]
        assert server.posted("/queue") == [{"delete": [prompt_id]}]
    assert f"asked {server.url} to stop prompt {prompt_id}" in str(excinfo.value)


class SlowPromptComfyUI(FakeComfyUI):
    """Answers POST /prompt only after `delay` seconds (the prompt is queued by then)."""

    def __init__(self, delay: float):
        super().__init__("success")
        self.delay = delay

    def _handler(self):
        base = super()._handler()
        server = self

        class Handler(base):
            def prompt(self, body):
                time.sleep(server.delay)
                server.log.append(("prompt answered", body["prompt_id"]))
                return super().prompt(body)

        return Handler


def test_a_stop_while_the_prompt_is_being_posted_still_cancels_it(tmp_path):
    """The several-server runner's main thread stops a worker's client (cancel_in_flight) while
    the worker's POST /prompt is on the wire: the server has nothing to cancel yet, so the run
    cancels the prompt itself once it is posted, instead of following it to the end."""
    with SlowPromptComfyUI(delay=0.5) as server:
        client = Client(server.url)
        outcome = []

        def run():
            try:
                outcome.append(client.run(WORKFLOW, tmp_path))
            except RemoteInterrupted as exc:
                outcome.append(exc)

        worker = threading.Thread(target=run)
        worker.start()
        deadline = time.time() + 10
        while not server.posted("/prompt") and time.time() < deadline:
            time.sleep(0.01)
        client.cancel_in_flight()  # the prompt is not answered yet
        worker.join(10)
        log = list(server.log)
    (result,) = outcome
    assert isinstance(result, RemoteInterrupted)
    answered = log.index(("prompt answered", result.prompt_id))
    after = [entry[1:] for entry in log[answered:] if entry[0] == "POST"]
    assert ("/queue", {"delete": [result.prompt_id]}) in after
    assert ("/interrupt", {"prompt_id": result.prompt_id}) in after


class QueuedComfyUI(FakeComfyUI):
    """Queues every prompt behind someone else's: none of ours starts."""

    def play(self, client_id: str, prompt_id: str) -> None:
        pass


def test_a_stop_takes_a_queued_prompt_off_the_queue_and_ends_its_run(tmp_path):
    """A prompt still queued when the several-server runner stops (cancel_in_flight) is taken
    off the queue, so it will never run: its run stops waiting for it at once, and a later run
    of that client posts nothing."""
    with QueuedComfyUI("success") as server:
        client = Client(server.url, poll_seconds=0.2)
        outcome = []
        worker = threading.Thread(target=lambda: outcome.append(
            pytest.raises(RemoteInterrupted, client.run, WORKFLOW, tmp_path).value))
        worker.start()
        deadline = time.time() + 10
        while not server.posted("/prompt") and time.time() < deadline:
            time.sleep(0.01)
        time.sleep(0.3)  # the run is waiting
        prompt_id = client.cancel_in_flight()
        worker.join(5)
        assert not worker.is_alive()
        (stopped,) = outcome
        assert stopped.prompt_id == prompt_id == server.posted("/prompt")[0]["prompt_id"]
        assert server.posted("/queue") == [{"delete": [prompt_id]}]
        assert server.posted("/interrupt") == [{"prompt_id": prompt_id}]
        with pytest.raises(RemoteInterrupted, match="before the prompt was posted"):
            client.run(WORKFLOW, tmp_path)
        assert len(server.posted("/prompt")) == 1


def test_a_partly_queued_prompt_is_a_rejection_and_is_taken_off_the_queue(tmp_path, capsys):
    """ComfyUI answers 200 with node_errors when some outputs pass validation and queues those
    alone: the client says what the server refused, removes the prompt, exits 2, records it."""
    workflow = tmp_path / "wf.json"
    workflow.write_text(json.dumps(WORKFLOW))
    results = tmp_path / "results.jsonl"
    with FakeComfyUI("partial") as server:
        with pytest.raises(PromptRejected) as excinfo:
            Client(server.url).run(WORKFLOW, tmp_path / "out")
        prompt_id = excinfo.value.prompt_id
        assert server.posted("/queue") == [{"delete": [prompt_id]}]
        assert server.posted("/interrupt") == [{"prompt_id": prompt_id}]
        code = cli.main(["run", str(workflow), "--server", server.url, "--out",
                         str(tmp_path / "out"), "--results", str(results), "--quiet"])
    assert 'node 3 (WanEnhancedSaveVideo), input "latent": Return type mismatch between linked ' \
           "nodes: latent, received_type(*) mismatch input_type(LATENT)" in str(excinfo.value)
    assert code == 2 and "failed validation" in capsys.readouterr().err
    (line,) = [json.loads(text) for text in results.read_text().splitlines()]
    assert line["status"] == "error" and "received_type(*)" in line["error"]
    assert line["prompt_id"] and not line["outputs"]


def test_a_run_without_any_output_is_a_failure(tmp_path, capsys):
    workflow = tmp_path / "wf.json"
    workflow.write_text(json.dumps(WORKFLOW))
    results = tmp_path / "results.jsonl"
    with FakeComfyUI("no-outputs") as server:
        with pytest.raises(MissingOutputs) as excinfo:
            Client(server.url).run(WORKFLOW, tmp_path / "out")
        code = cli.main(["run", str(workflow), "--server", server.url, "--out",
                         str(tmp_path / "out"), "--results", str(results), "--quiet"])
    assert "none of the workflow's output nodes produced an output: 3 " \
           "(WanEnhancedSaveVideo)" in str(excinfo.value)
    assert code == 1 and "produced an output" in capsys.readouterr().err
    (line,) = [json.loads(text) for text in results.read_text().splitlines()]
    assert line["status"] == "error" and line["prompt_id"]


@pytest.mark.parametrize("sigint, code, status", [
    ("interactive_sigint", 1, "interrupted"),
    ("ignored_sigint", 0, "success"),
])
def test_ctrl_c_interrupts_a_server_run_unless_sigint_was_ignored_at_start(
        sigint, code, status, tmp_path, request, capsys):
    """A run started with SIGINT ignored (`wan-enhanced run --server ... &` in a script) is a
    background job: Ctrl-C in the terminal is not meant for it, and its prompt runs to its end."""
    request.getfixturevalue(sigint)
    handler = signal.getsignal(signal.SIGINT)
    workflow = tmp_path / "wf.json"
    workflow.write_text(json.dumps(WORKFLOW))
    results = tmp_path / "results.jsonl"
    with SignalComfyUI() as server:
        got = cli.main(["run", str(workflow), "--server", server.url, "--out",
                        str(tmp_path / "out"), "--results", str(results), "--quiet"])
        prompt_id = server.posted("/prompt")[0]["prompt_id"]
        interrupts = server.posted("/interrupt")
    assert got == code, capsys.readouterr().err
    (line,) = [json.loads(text) for text in results.read_text().splitlines()]
    assert line["status"] == status and line["prompt_id"] == prompt_id
    assert interrupts == ([{"prompt_id": prompt_id}] if status == "interrupted" else [])
    assert (tmp_path / "out" / "wan" / "clip_00001.mp4").exists() == (status == "success")
    assert signal.getsignal(signal.SIGINT) == handler  # put back, or never replaced


def test_two_ctrl_c_microseconds_apart_still_interrupt_the_server(tmp_path):
    """What `timeout -s INT` and an impatient user do: the second SIGINT lands while the first
    one's cancel requests are on the wire (the fake server answers /queue after 0.1 s). The
    /interrupt must still be sent, and the command exits 1."""
    workflow = tmp_path / "wf.json"
    workflow.write_text(json.dumps(WORKFLOW))
    # SIGINT as a terminal's, also where the tests run as a background job (SIGINT ignored)
    command = [sys.executable, "-c", "import signal, sys; "
               "signal.signal(signal.SIGINT, signal.default_int_handler); "
               "from wan_enhanced.runner.cli import main; "
               "sys.exit(main(sys.argv[1:]))", "run", str(workflow), "--out",
               str(tmp_path / "out"), "--quiet"]
    with FakeComfyUI("interrupt") as server:
        process = subprocess.Popen(command + ["--server", server.url], stderr=subprocess.PIPE,
                                   text=True)
        deadline = time.time() + 60
        while ("sent", "progress", "2") not in server.log and time.time() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)  # the client is reading the websocket
        os.kill(process.pid, signal.SIGINT)
        time.sleep(0.002)
        os.kill(process.pid, signal.SIGINT)
        _, err = process.communicate(timeout=60)
        prompt_id = server.posted("/prompt")[0]["prompt_id"]
        assert server.posted("/interrupt") == [{"prompt_id": prompt_id}], err
    assert process.returncode == 1, err
    assert f"asked {server.url} to stop prompt {prompt_id}" in err


@pytest.mark.parametrize("sigint", ["interactive_sigint", "ignored_sigint"])
def test_sigterm_interrupts_a_server_run_also_where_sigint_was_ignored_at_start(
        sigint, tmp_path, request, stray_sigterm, capsys):
    """`kill` (SIGTERM) stops a server run as Ctrl-C does: the prompt is taken off the server's
    queue and interrupted there, the job recorded as interrupted, exit 1; also in a background
    job (SIGINT ignored), whose prompt would otherwise run on, its GPU time wasted."""
    request.getfixturevalue(sigint)
    handlers = [signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)]
    workflow = tmp_path / "wf.json"
    workflow.write_text(json.dumps(WORKFLOW))
    results = tmp_path / "results.jsonl"
    with SignalComfyUI(signal.SIGTERM) as server:
        got = cli.main(["run", str(workflow), "--server", server.url, "--out",
                        str(tmp_path / "out"), "--results", str(results), "--quiet"])
        prompt_id = server.posted("/prompt")[0]["prompt_id"]
        cancels = server.posted("/queue"), server.posted("/interrupt")
    assert got == 1, capsys.readouterr().err
    (line,) = [json.loads(text) for text in results.read_text().splitlines()]
    assert line["status"] == "interrupted" and line["prompt_id"] == prompt_id
    assert cancels == ([{"delete": [prompt_id]}], [{"prompt_id": prompt_id}])
    assert not (tmp_path / "out" / "wan" / "clip_00001.mp4").exists()
    assert stray_sigterm == []  # the run's handler took it
    assert [signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)] == handlers


@pytest.mark.parametrize("second", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_second_signal_during_the_cleanup_cuts_nothing(second, tmp_path, interactive_sigint,
                                                          stray_sigterm, monkeypatch, capsys):
    """After SIGTERM, a second signal (an impatient `kill`, Ctrl-C) lands while the cancel
    requests are sent and again while the results line is written: both requests still reach
    the server, the line is whole, the exit code 1."""
    from wan_enhanced.runner.sweep import ResultsLog

    cancel, append = Client.cancel, ResultsLog.append
    monkeypatch.setattr(Client, "cancel", lambda client, prompt_id: (
        os.kill(os.getpid(), second), cancel(client, prompt_id)))
    monkeypatch.setattr(ResultsLog, "append", lambda log, line: (
        os.kill(os.getpid(), second), append(log, line)))
    workflow = tmp_path / "wf.json"
    workflow.write_text(json.dumps(WORKFLOW))
    results = tmp_path / "results.jsonl"
    with SignalComfyUI(signal.SIGTERM) as server:
        got = cli.main(["run", str(workflow), "--server", server.url, "--out",
                        str(tmp_path / "out"), "--results", str(results), "--quiet"])
        prompt_id = server.posted("/prompt")[0]["prompt_id"]
        cancels = server.posted("/queue"), server.posted("/interrupt")
    err = capsys.readouterr().err
    assert got == 1, err
    (line,) = [json.loads(text) for text in results.read_text().splitlines()]
    assert line["status"] == "interrupted" and line["prompt_id"] == prompt_id
    assert cancels == ([{"delete": [prompt_id]}], [{"prompt_id": prompt_id}])
    assert stray_sigterm == [] and "Traceback" not in err


def test_kill_stops_a_server_run_started_as_a_background_job(tmp_path):
    """`wan-enhanced run --server ... &` in a script, then `kill PID`: the shell started it with
    SIGINT ignored, and SIGTERM, which used to end it on the spot (its prompt running on, no
    results line), stops it as Ctrl-C would: prompt cancelled on the server, line, exit 1."""
    workflow = tmp_path / "wf.json"
    workflow.write_text(json.dumps(WORKFLOW))
    results = tmp_path / "results.jsonl"
    command = ["sh", "-c", "trap '' INT; exec \"$@\"", "sh",  # as `cmd &` starts it
               sys.executable, "-c", "import sys; from wan_enhanced.runner.cli import main; "
               "sys.exit(main(sys.argv[1:]))", "run", str(workflow), "--out",
               str(tmp_path / "out"), "--results", str(results), "--quiet"]
    with FakeComfyUI("interrupt") as server:
        process = subprocess.Popen(command + ["--server", server.url], stderr=subprocess.PIPE,
                                   text=True)
        try:
            deadline = time.time() + 60
            while ("sent", "progress", "2") not in server.log and time.time() < deadline:
                time.sleep(0.01)
            time.sleep(0.2)  # the client is reading the websocket
            process.send_signal(signal.SIGTERM)
            _, err = process.communicate(timeout=60)
        finally:
            if process.poll() is None:
                process.kill()
        prompt_id = server.posted("/prompt")[0]["prompt_id"]
        cancels = server.posted("/queue"), server.posted("/interrupt")
    assert process.returncode == 1, err  # an exit code, not death by signal (-15)
    assert cancels == ([{"delete": [prompt_id]}], [{"prompt_id": prompt_id}]), err
    (line,) = [json.loads(text) for text in results.read_text().splitlines()]
    assert line["status"] == "interrupted" and line["prompt_id"] == prompt_id
    assert "Traceback" not in err


def test_lost_websocket_falls_back_to_polling_history(tmp_path):
    with FakeComfyUI("drop") as server:
        result = Client(server.url, poll_seconds=0.1).run(WORKFLOW, tmp_path)
    assert result.status == "success"
    assert (tmp_path / "wan" / "clip_00001.mp4").read_bytes() == VIDEO


def test_unreachable_server_is_a_clear_error(tmp_path):
    with FakeComfyUI("success") as server:
        url = server.url
    with pytest.raises(Exception, match=f"cannot reach ComfyUI at {url}"):
        Client(url, timeout=2).object_info()


def test_run_command_on_a_server_with_set_and_sweep(tmp_path, capsys):
    workflow = tmp_path / "wf.json"
    workflow.write_text(json.dumps(WORKFLOW))
    sweep = tmp_path / "sweep.json"
    sweep.write_text(json.dumps({"seed": [1, 2]}))
    out = tmp_path / "out"
    with FakeComfyUI("success") as server:
        code = cli.main(["run", str(workflow), "--server", server.url, "--out", str(out),
                         "--set", "Sampler.steps=4", "--set", "3.format=webm",
                         "--sweep", str(sweep), "--quiet"])
        prompts = [body["prompt"] for body in server.posted("/prompt")]
        assert cli.main(["run", str(workflow), "--server", server.url, "--set",
                         "Sampler.steps=lots"]) == 2
    assert code == 0, capsys.readouterr().err
    assert [(p["2"]["inputs"]["seed"], p["2"]["inputs"]["steps"], p["3"]["inputs"]["format"])
            for p in prompts] == [(1, 4, "webm"), (2, 4, "webm")]
    assert (out / "wan" / "clip_00001.mp4").read_bytes() == VIDEO
    lines = [json.loads(line) for line in
             (tmp_path / "sweep.results.jsonl").read_text().splitlines()]
    assert [line["status"] for line in lines] == ["success", "success"]
    assert all(line["prompt_id"] and line["outputs"] for line in lines)
    assert "expected an integer (INT), got 'lots'" in capsys.readouterr().err


def test_a_download_never_replaces_a_file_in_the_output_folder(tmp_path):
    """A folder shared with headless runs, or a server whose numbering restarted: the file
    already there stays, the download takes the next free name."""
    out = tmp_path / "out"
    (out / "wan").mkdir(parents=True)
    mine = out / "wan" / "clip_00001.mp4"
    mine.write_bytes(b"a video of a headless run")
    with FakeComfyUI("success") as server:
        first = Client(server.url).run(WORKFLOW, out)
        second = Client(server.url).run(WORKFLOW, out)
    assert mine.read_bytes() == b"a video of a headless run"
    assert first.files[0] == str(out / "wan" / "clip_00001-2.mp4")
    assert second.files[0] == str(out / "wan" / "clip_00001-3.mp4")
    assert (out / "wan" / "clip_00001-2.mp4").read_bytes() == VIDEO
    assert sorted(p.name for p in (out / "wan").iterdir()) == [
        "clip_00001-2.mp4", "clip_00001-3.mp4", "clip_00001.mp4"]  # no .part, no .claim


def test_a_verdict_comfyui_files_under_every_input_it_names_is_placed_at_its_input():
    """ComfyUI files a VALIDATE_INPUTS verdict under each input the check names (execution.py:
    one error per input, "details": "INPUT - VERDICT"); each line of ours names its input."""
    verdict = "frames: 50 is not of the form 4n+1 (nearest valid: 49 or 53)"
    workflow = {"5": {"class_type": "WanEnhancedEmptyLatent", "inputs": {
        "model": ["1", 0], "width": 832, "height": 480, "frames": 50, "batch": 1}}}
    node_errors = {"5": {"class_type": "WanEnhancedEmptyLatent", "dependent_outputs": ["8"],
                         "errors": [{"type": "custom_validation_failed",
                                     "message": "Custom validation failed for node",
                                     "details": f"{name} - {verdict}",
                                     "extra_info": {"input_name": name}}
                                    for name in ("width", "height", "frames", "batch")]},
                   "7": {"class_type": "OtherPack", "errors": [
                       {"type": "custom_validation_failed",
                        "message": "Custom validation failed for node",
                        "details": f"{name} - too big", "extra_info": {"input_name": name}}
                       for name in ("a", "b")]}}
    workflow["7"] = {"class_type": "OtherPack", "inputs": {"a": 1, "b": 2}}
    rejected = PromptRejected({"message": "Prompt outputs failed validation"}, node_errors,
                              workflow)
    assert [(i.node_id, i.input_name, i.message) for i in rejected.errors] == [
        ("5", "frames", f"Custom validation failed for node: {verdict}"),
        ("7", "a", "Custom validation failed for node: too big"),
        ("7", "b", "Custom validation failed for node: too big")]
    assert str(rejected).count("4n+1") == 1


@pytest.mark.parametrize("version, star_fits", [("0.3.64", False), ("0.30.0", True),
                                                (None, True)])
def test_the_servers_registry_checks_links_by_its_release(version, star_fits):
    """The registry built from a server's /object_info carries the link rule of the ComfyUI
    release /system_stats names (a server that does not say gets today's rule)."""
    from wan_enhanced.runner.workflow import types_compatible

    with FakeComfyUI("ok", version=version) as server:
        client = Client(server.url, timeout=5)
        registry = client.registry()
        assert client.comfyui_version() == version
    assert set(registry) == set(OBJECT_INFO)
    assert types_compatible("*", "LATENT", registry.link_rule) is star_fits
