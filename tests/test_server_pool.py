"""`wan-enhanced run --server URL1,URL2`: a sweep shared by several (fake) ComfyUI servers, one
results file, reruns that skip what any server finished, a server that goes away mid-sweep."""

import json

import pytest
from test_client import WORKFLOW, FakeComfyUI, SignalComfyUI, VIDEO

from wan_enhanced.runner import cli
from wan_enhanced.runner.server_pool import server_folder, server_urls
from wan_enhanced.runner.sweep import job_scope


class DyingComfyUI(FakeComfyUI):
    """Takes `prompts` prompts, then answers every POST /prompt with 500."""

    def __init__(self, prompts: int):
        super().__init__("success")
        self.prompts_left = prompts

    def _handler(self):
        base = super()._handler()
        server = self

        class Handler(base):
            def prompt(self, body):
                if server.prompts_left <= 0:
                    return self.reply(500, {"error": "out of service"})
                server.prompts_left -= 1
                return super().prompt(body)

        return Handler


@pytest.fixture
def sweep_files(tmp_path):
    workflow = tmp_path / "wf.json"
    workflow.write_text(json.dumps(WORKFLOW))
    sweep = tmp_path / "sweep.json"
    sweep.write_text(json.dumps({"seed": [1, 2, 3, 4]}))
    return workflow, sweep, tmp_path / "out", tmp_path / "sweep.results.jsonl"


def _lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_two_servers_share_a_sweep_and_a_rerun_skips_it(sweep_files, capsys):
    workflow, sweep, out, results = sweep_files
    with FakeComfyUI("success") as a, FakeComfyUI("success") as b:
        urls = f"{a.url},{b.url}"
        code = cli.main(["run", str(workflow), "--server", urls, "--out", str(out),
                         "--sweep", str(sweep), "--quiet"])
        seeds = sorted(p["prompt"]["2"]["inputs"]["seed"] for s in (a, b)
                       for p in s.posted("/prompt"))
        busy = [len(s.posted("/prompt")) for s in (a, b)]
        again = cli.main(["run", str(workflow), "--server", f"{b.url},{a.url}", "--out",
                          str(out), "--sweep", str(sweep), "--quiet"])
        after = sum(len(s.posted("/prompt")) for s in (a, b))
    assert code == 0 and again == 0, capsys.readouterr().err
    assert seeds == [1, 2, 3, 4] and all(n >= 1 for n in busy)  # each job once, both busy
    assert after == 4  # the rerun posted nothing
    lines = _lines(results)
    assert [line["status"] for line in lines] == ["success"] * 4
    assert {line["server"] for line in lines} == {a.url, b.url}
    for server in (a, b):
        assert (out / server_folder(server.url) / "wan" / "clip_00001.mp4").read_bytes() == VIDEO
    assert "4 of 4 job(s) already succeeded" in capsys.readouterr().err


def test_a_server_that_goes_away_hands_its_job_on(sweep_files, capsys):
    workflow, sweep, out, results = sweep_files
    with FakeComfyUI("success") as good, DyingComfyUI(prompts=1) as dying:
        code = cli.main(["run", str(workflow), "--server", f"{dying.url},{good.url}", "--out",
                         str(out), "--sweep", str(sweep), "--quiet"])
    err = capsys.readouterr().err
    assert code == 0, err
    assert f"[{dying.url}] dropped: POST /prompt on {dying.url} answered 500" in err
    lines = _lines(results)
    assert sorted(line["settings"]["seed"] for line in lines) == [1, 2, 3, 4]
    assert all(line["status"] == "success" for line in lines)


def test_failures_are_recorded_per_job(sweep_files, capsys):
    workflow, sweep, out, results = sweep_files
    with FakeComfyUI("error") as a, FakeComfyUI("error") as b:
        code = cli.main(["run", str(workflow), "--server", f"{a.url},{b.url}", "--out",
                         str(out), "--sweep", str(sweep), "--quiet"])
    assert code == 1
    lines = _lines(results)
    assert [line["status"] for line in lines] == ["error"] * 4
    assert "CUDA out of memory" in lines[0]["error"]


def test_a_rejected_workflow_stops_the_pool(sweep_files):
    workflow, sweep, out, results = sweep_files
    with FakeComfyUI("reject") as a, FakeComfyUI("reject") as b:
        code = cli.main(["run", str(workflow), "--server", f"{a.url},{b.url}", "--out",
                         str(out), "--sweep", str(sweep), "--quiet"])
        posted = sum(len(s.posted("/prompt")) for s in (a, b))
    assert code == 2 and posted <= 2


def test_an_unreachable_server_is_named_before_any_job(sweep_files, capsys):
    workflow, sweep, out, results = sweep_files
    with FakeComfyUI("success") as gone:
        dead = gone.url
    with FakeComfyUI("success") as a:
        code = cli.main(["run", str(workflow), "--server", f"{a.url},{dead}", "--out",
                         str(out), "--sweep", str(sweep), "--quiet"])
        assert a.posted("/prompt") == []
    assert code == 1 and f"cannot reach ComfyUI at {dead}" in capsys.readouterr().err


def test_server_lists_and_scopes():
    assert server_urls("a:1, b:2") == ["a:1", "b:2"]
    with pytest.raises(ValueError, match="named twice"):
        server_urls("http://a:1,http://a:1/")
    assert server_folder("http://127.0.0.1:8188") == "127.0.0.1-8188"
    assert server_folder("gpu-box") == "gpu-box-80"
    assert job_scope("o", "http://a:1,http://b:2") == job_scope("o", "http://b:2,http://a:1")
    assert job_scope("o", "http://a:1") != job_scope("o", "http://a:1,http://b:2")


def _assert_each_server_cancelled_only_our_prompt(servers):
    """Each server was asked to drop and to interrupt the prompt we posted to it, by its id: an
    interrupt without one would stop whatever the server runs, another user's prompt too."""
    for server in servers:
        ours = [p["prompt_id"] for p in server.posted("/prompt")]
        assert len(ours) == 1
        assert server.posted("/queue") == [{"delete": ours}]
        assert server.posted("/interrupt") == [{"prompt_id": ours[0]}]


def test_ctrl_c_interrupts_every_server(sweep_files, interactive_sigint, capsys):
    import os
    import signal
    import threading

    workflow, sweep, out, results = sweep_files
    with FakeComfyUI("interrupt") as a, FakeComfyUI("interrupt") as b:
        timer = threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT))
        timer.start()
        code = cli.main(["run", str(workflow), "--server", f"{a.url},{b.url}", "--out",
                         str(out), "--sweep", str(sweep), "--quiet"])
        timer.join()
        assert all(s.interrupted.is_set() for s in (a, b))
        _assert_each_server_cancelled_only_our_prompt((a, b))
    assert code == 1
    lines = _lines(results)
    assert [line["status"] for line in lines] == ["interrupted", "interrupted"]
    assert "interrupted: asking every server to stop its prompt" in capsys.readouterr().err


def test_ctrl_c_leaves_a_sweep_alone_where_sigint_was_ignored_at_start(sweep_files, ignored_sigint,
                                                                     capsys):
    """A sweep started with SIGINT ignored (`wan-enhanced run --server A,B ... &` in a script) is
    a background job: Ctrl-C, pressed as the first prompt starts, stops nothing."""
    import signal

    workflow, sweep, out, results = sweep_files
    with SignalComfyUI() as a, FakeComfyUI("success") as b:
        code = cli.main(["run", str(workflow), "--server", f"{a.url},{b.url}", "--out",
                         str(out), "--sweep", str(sweep), "--quiet"])
        assert a.pressed.is_set()
        prompts = sum(len(s.posted("/prompt")) for s in (a, b))
        interrupts = [s.posted("/interrupt") for s in (a, b)]
    err = capsys.readouterr().err
    assert code == 0, err
    assert prompts == 4 and interrupts == [[], []]
    assert [line["status"] for line in _lines(results)] == ["success"] * 4
    assert "interrupted" not in err
    assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN


def _signal_once_both_run(servers, signum):
    """`signum` to this process once every server has a prompt running."""
    import os
    import signal
    import threading
    import time

    def wait_and_send():
        deadline = time.time() + 30
        while not all(("sent", "progress", "2") in s.log for s in servers) and \
                time.time() < deadline:
            time.sleep(0.01)
        os.kill(os.getpid(), signum)

    thread = threading.Thread(target=wait_and_send, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("sigint", ["interactive_sigint", "ignored_sigint"])
def test_sigterm_interrupts_every_server_also_where_sigint_was_ignored_at_start(
        sigint, sweep_files, request, stray_sigterm, capsys):
    """`kill` (SIGTERM) stops a sweep on several servers as Ctrl-C does, also in a background job
    (SIGINT ignored): every server interrupts its prompt, both jobs are recorded as interrupted,
    the others do not start, exit 1."""
    import signal

    request.getfixturevalue(sigint)
    handlers = [signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)]
    workflow, sweep, out, results = sweep_files
    with FakeComfyUI("interrupt") as a, FakeComfyUI("interrupt") as b:
        sender = _signal_once_both_run((a, b), signal.SIGTERM)
        code = cli.main(["run", str(workflow), "--server", f"{a.url},{b.url}", "--out",
                         str(out), "--sweep", str(sweep), "--quiet"])
        sender.join()
        interrupted = [s.interrupted.is_set() for s in (a, b)]
        prompts = sum(len(s.posted("/prompt")) for s in (a, b))
        _assert_each_server_cancelled_only_our_prompt((a, b))
    err = capsys.readouterr().err
    assert code == 1, err
    assert interrupted == [True, True] and prompts == 2
    assert [line["status"] for line in _lines(results)] == ["interrupted", "interrupted"], err
    assert "interrupted: asking every server to stop its prompt" in err
    assert stray_sigterm == []  # the run's handler took it
    assert [signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)] == handlers


@pytest.mark.parametrize("second", ["SIGTERM", "SIGINT"])
def test_a_second_signal_while_the_servers_stop_cuts_nothing(second, sweep_files,
                                                             interactive_sigint, stray_sigterm,
                                                             monkeypatch, capsys):
    """After SIGTERM, a second signal (an impatient `kill`, Ctrl-C) lands as each server's job
    is recorded: the run still waits for both lines, writes them whole and exits 1, no
    traceback."""
    import os
    import signal

    from wan_enhanced.runner.sweep import ResultsLog

    append = ResultsLog.append

    def signal_then_append(log, line):
        os.kill(os.getpid(), getattr(signal, second))
        append(log, line)

    monkeypatch.setattr(ResultsLog, "append", signal_then_append)
    workflow, sweep, out, results = sweep_files
    with FakeComfyUI("interrupt") as a, FakeComfyUI("interrupt") as b:
        sender = _signal_once_both_run((a, b), signal.SIGTERM)
        try:
            code = cli.main(["run", str(workflow), "--server", f"{a.url},{b.url}", "--out",
                             str(out), "--sweep", str(sweep), "--quiet"])
        except KeyboardInterrupt:  # the command would end with a traceback
            pytest.fail("the second signal escaped the run as KeyboardInterrupt")
        sender.join()
    err = capsys.readouterr().err
    assert code == 1, err
    assert [line["status"] for line in _lines(results)] == ["interrupted", "interrupted"]
    assert stray_sigterm == [] and "Traceback" not in err
