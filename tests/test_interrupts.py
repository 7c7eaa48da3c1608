"""Interrupts reach inside a step: the sampler checks between the transformer blocks of a
forward (the first Ctrl-C no longer waits for a whole step), the decoder between decoded frames;
and a second Ctrl-C or SIGTERM stops the command at once with its documented exit code, even
while the main thread is held by one long operation; a run started with SIGINT ignored (a
background job) runs on through Ctrl-C, and `kill` (SIGTERM) stops it as Ctrl-C would."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from wan_enhanced import host
from wan_enhanced.nodes import NODE_CLASS_MAPPINGS as NODES
from wan_enhanced.runner.run_command import FAILED

from tiny_sets import DIT, VAE


@pytest.fixture(scope="module")
def models(ti2v_models):
    return ti2v_models


@pytest.fixture
def headless(models, tmp_path):
    host.set_headless_folders(models=models, output=tmp_path / "out")
    host.clear_interrupt()
    yield
    host.clear_interrupt()
    host.set_headless_folders(models="models", output="output")


def test_sampler_stops_between_transformer_blocks(headless, monkeypatch):
    (model,) = NODES["WanEnhancedModelLoader"]().load(DIT, "fp32", "sdpa")
    (latent,) = NODES["WanEnhancedEmptyLatent"]().make(model, 64, 64, 5, 1)
    rows = [[torch.zeros(1, 4, model.config.text_dim), {}]]
    blocks = list(model.model.blocks)
    assert len(blocks) >= 2
    ran = []
    real_forward = type(blocks[0]).forward

    def forward(block, *args, **kwargs):
        ran.append(blocks.index(block))
        if len(ran) == 1:
            host.request_interrupt()  # Ctrl-C while the first block computes
        return real_forward(block, *args, **kwargs)

    monkeypatch.setattr(type(blocks[0]), "forward", forward)
    with pytest.raises(host.Interrupted):  # one step only: before, it ran to the end
        NODES["WanEnhancedSampler"]().run(model, rows, rows, latent, 1, 1, 1.0, 5.0, "unipc",
                                          1.0)
    assert ran == [0]  # the check before the second block stopped the forward
    monkeypatch.undo()
    (out,) = NODES["WanEnhancedSampler"]().run(model, rows, rows, latent, 1, 1, 1.0, 5.0, "unipc",
                                               1.0)
    assert torch.isfinite(out["samples"]).all()  # the next run works


def test_sampler_stops_between_the_row_chunks_of_a_block(headless, monkeypatch):
    """At large sizes a block's phases run over row chunks; a stop request is honoured between
    two chunks (the first Ctrl-C no longer waits for a whole block)."""
    from wan_enhanced.wan import chunks
    from wan_enhanced.wan.dit_attention import SelfAttention

    (model,) = NODES["WanEnhancedModelLoader"]().load(DIT, "fp32", "sdpa")
    (latent,) = NODES["WanEnhancedEmptyLatent"]().make(model, 64, 64, 5, 1)
    rows = [[torch.zeros(1, 4, model.config.text_dim), {}]]
    monkeypatch.setattr(chunks, "ROW_CHUNK_TOKENS", 4)  # the sizes' chunking, on a tiny model
    attended = []
    real = SelfAttention.attend_rows

    def attend_rows(attn, h, rope, start, *args):
        attended.append(start)
        if len(attended) == 1:
            host.request_interrupt()  # Ctrl-C while the first chunk's queries attend
        return real(attn, h, rope, start, *args)

    monkeypatch.setattr(SelfAttention, "attend_rows", attend_rows)
    with pytest.raises(host.Interrupted):
        NODES["WanEnhancedSampler"]().run(model, rows, rows, latent, 1, 1, 1.0, 5.0, "unipc",
                                          1.0)
    assert attended == [0]  # the check before the second chunk stopped the block
    monkeypatch.undo()
    (out,) = NODES["WanEnhancedSampler"]().run(model, rows, rows, latent, 1, 1, 1.0, 5.0, "unipc",
                                               1.0)
    assert torch.isfinite(out["samples"]).all()  # the next run works


def test_decoder_stops_between_decoded_frames(headless, monkeypatch):
    (vae,) = NODES["WanEnhancedVAELoader"]().load(VAE, "fp32")
    latent = {"samples": torch.randn(1, 48, 4, 4, 4)}
    decoded = []
    real = host.Progress.update_to

    def progress(bar, value):
        decoded.append(value)
        if value == 2:
            host.request_interrupt()
        real(bar, value)

    monkeypatch.setattr(host.Progress, "update_to", progress)
    with pytest.raises(host.Interrupted):
        NODES["WanEnhancedTiledDecode"]().run(vae, latent, 32, 32, 16, 16, "untiled")
    assert decoded == [1, 2]  # 4 latent frames: stopped after the second


STUCK_NODE = textwrap.dedent("""
    import ctypes, json, signal, sys
    # SIGINT as a terminal's, also where the tests run as a background job (SIGINT ignored)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    import wan_enhanced
    from wan_enhanced.runner import cli

    class Stuck:
        '''Holds the main thread in one C call, as one long attention does.'''
        @classmethod
        def INPUT_TYPES(cls):
            return {"required": {}}
        RETURN_TYPES = ()
        FUNCTION = "run"
        OUTPUT_NODE = True

        def run(self):
            # a signal blocked here reaches another thread, as when the main thread is in C code
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM, signal.SIGHUP})
            print("ready", flush=True)
            ctypes.CDLL(None).sleep(60)
            return {}

    wan_enhanced.NODE_CLASS_MAPPINGS["Stuck"] = Stuck
    path = sys.argv[1]
    open(path, "w").write(json.dumps({"1": {"class_type": "Stuck", "inputs": {}}}))
    sys.exit(cli.main(["run", path, "--out", sys.argv[2]]))
""")


def _hangup_default():
    """In a child before it starts: SIGHUP as a terminal's process has it, whatever this test
    run started with (a test run under `nohup` would hand its children SIGHUP ignored)."""
    signal.signal(signal.SIGHUP, signal.SIG_DFL)


@pytest.mark.skipif(os.name != "posix", reason="POSIX signals")
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP],
                         ids=["SIGINT", "SIGTERM", "SIGHUP"])
def test_two_signals_exit_with_the_documented_code_while_an_operation_holds(signum, tmp_path):
    """Ctrl-C twice, `kill` twice, or two hangups."""
    script = tmp_path / "stuck.py"
    script.write_text(STUCK_NODE)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    process = subprocess.Popen([sys.executable, str(script), str(tmp_path / "w.json"),
                                str(tmp_path / "out")], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env=env,
                               preexec_fn=_hangup_default)
    try:
        assert process.stdout.readline().strip() == "ready"
        started = time.monotonic()
        process.send_signal(signum)
        time.sleep(0.5)
        process.send_signal(signum)
        code = process.wait(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
    err = process.stderr.read()
    assert code == FAILED, err  # an exit code, not death by signal (-2, -15)
    assert time.monotonic() - started < 20  # not the 60 s the operation would take
    assert "stopping at the next check" in err and "stopping now" in err


WAITING_NODE = textwrap.dedent("""
    import json, signal, sys
    import wan_enhanced
    from wan_enhanced import host
    from wan_enhanced.runner import cli

    class Waits:
        '''Runs until the test writes a line to stdin, then stops if asked to.'''
        @classmethod
        def INPUT_TYPES(cls):
            return {"required": {}}
        RETURN_TYPES = ()
        FUNCTION = "run"
        OUTPUT_NODE = True

        def run(self):
            print("ready", signal.getsignal(signal.SIGINT) == signal.SIG_IGN, flush=True)
            sys.stdin.readline()
            host.check_interrupt()
            return {}

    wan_enhanced.NODE_CLASS_MAPPINGS["Waits"] = Waits
    path = sys.argv[1]
    open(path, "w").write(json.dumps({"1": {"class_type": "Waits", "inputs": {}}}))
    sys.exit(cli.main(["run", path, "--out", sys.argv[2], "--results", sys.argv[3]]))
""")


@pytest.mark.skipif(os.name != "posix", reason="POSIX signals")
def test_ctrl_c_does_not_stop_a_run_started_with_sigint_ignored(tmp_path):
    """`wan-enhanced run ... &` in a script: the shell starts the job with SIGINT ignored, so
    the terminal's Ctrl-C is not for it; two of them (the second would stop a run at once) leave
    the run to finish and record its success."""
    script = tmp_path / "waits.py"
    script.write_text(WAITING_NODE)
    results = tmp_path / "r.jsonl"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    command = ["sh", "-c", "trap '' INT; exec \"$@\"", "sh",  # as `cmd &` starts it
               sys.executable, str(script), str(tmp_path / "w.json"), str(tmp_path / "out"),
               str(results)]
    process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert process.stdout.readline().split() == ["ready", "True"]  # started ignoring it
        for _ in range(2):
            process.send_signal(signal.SIGINT)
            time.sleep(0.5)
        _, err = process.communicate("go\n", timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 0, err
    (line,) = [json.loads(text) for text in results.read_text().splitlines()]
    assert line["status"] == "success"
    assert "stopping" not in err and "interrupted" not in err


@pytest.mark.skipif(os.name != "posix", reason="POSIX signals")
def test_kill_stops_a_run_started_with_sigint_ignored(tmp_path):
    """`wan-enhanced run ... &` in a script, then `kill PID`: Ctrl-C is not for it, but SIGTERM,
    which used to end it on the spot without a results line, stops it at the next check: the job
    is recorded as interrupted and the command exits 1."""
    script = tmp_path / "waits.py"
    script.write_text(WAITING_NODE)
    results = tmp_path / "r.jsonl"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    command = ["sh", "-c", "trap '' INT; exec \"$@\"", "sh",  # as `cmd &` starts it
               sys.executable, str(script), str(tmp_path / "w.json"), str(tmp_path / "out"),
               str(results)]
    process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert process.stdout.readline().split() == ["ready", "True"]  # started ignoring SIGINT
        process.send_signal(signal.SIGINT)
        process.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        _, err = process.communicate("go\n", timeout=60)  # the node's next check
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == FAILED, err  # an exit code, not death by signal (-15)
    (line,) = [json.loads(text) for text in results.read_text().splitlines()]
    assert line["status"] == "interrupted"
    assert "SIGTERM: stopping at the next check" in err and "Traceback" not in err


@pytest.mark.skipif(os.name != "posix", reason="POSIX signals")
@pytest.mark.parametrize("nohup", [False, True], ids=["terminal", "nohup"])
def test_a_hangup_stops_a_run_as_kill_does_unless_it_runs_under_nohup(nohup, tmp_path):
    """The terminal or SSH session of a run goes away (SIGHUP): the run stops at the next check,
    records its job as interrupted and exits 1, where a hangup used to end it on the spot with
    no results line. Under `nohup` (SIGHUP ignored from the start) it runs on to the end."""
    script = tmp_path / "waits.py"
    script.write_text(WAITING_NODE)
    results = tmp_path / "r.jsonl"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    trap = "trap '' HUP; " if nohup else ""
    command = ["sh", "-c", trap + "exec \"$@\"", "sh", sys.executable, str(script),
               str(tmp_path / "w.json"), str(tmp_path / "out"), str(results)]
    process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env=env,
                               preexec_fn=_hangup_default)
    try:
        assert process.stdout.readline().split()[0] == "ready"
        process.send_signal(signal.SIGHUP)
        time.sleep(0.5)
        _, err = process.communicate("go\n", timeout=60)  # the node's next check
    finally:
        if process.poll() is None:
            process.kill()
    (line,) = [json.loads(text) for text in results.read_text().splitlines()]
    if nohup:
        assert process.returncode == 0, err
        assert line["status"] == "success" and "stopping" not in err
    else:
        assert process.returncode == FAILED, err  # an exit code, not death by signal (-1)
        assert line["status"] == "interrupted"
        assert "SIGHUP: stopping at the next check" in err and "Traceback" not in err


SHUTDOWN = textwrap.dedent("""
    import atexit, os, signal, sys, time
    from wan_enhanced.runner import cli, run_command

    when, signum = sys.argv[1], getattr(signal, sys.argv[2])
    real_run = run_command.run

    def run_then_signal(args):
        code = real_run(args)
        if when == "unwinding":  # after the command's own handlers are back
            os.kill(os.getpid(), signum)
            time.sleep(2)
        return code

    run_command.run = run_then_signal

    def slow_teardown():  # models freed, threads ended: seconds in a real run
        os.kill(os.getpid(), signum)
        time.sleep(2)

    if when == "shutdown":
        atexit.register(slow_teardown)
    sys.argv = ["wan-enhanced", "run", sys.argv[3], "--quiet"]
    cli.entry()
""")


@pytest.mark.parametrize("when, signum, code", [
    ("unwinding", "SIGINT", FAILED),  # an interrupt: the documented 1
    ("shutdown", "SIGINT", 2),  # the command had ended: its own code (2: invalid workflow)
    ("shutdown", "SIGTERM", 2),
])
def test_a_signal_while_the_process_ends_exits_with_a_documented_code(tmp_path, when, signum,
                                                                      code):
    """Ctrl-C or `kill` after the command gave its handlers back (while it unwinds, or while
    the process shuts down): a documented exit code at once, not 130 / 143 or a traceback."""
    script = tmp_path / "shutdown.py"
    script.write_text(SHUTDOWN)
    process = subprocess.run([sys.executable, str(script), when, signum,
                              str(tmp_path / "missing.json")], capture_output=True, text=True,
                             timeout=60)
    assert process.returncode == code, process.stderr
    assert "Traceback" not in process.stderr and "KeyboardInterrupt" not in process.stderr
