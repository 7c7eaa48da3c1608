"""The rule of stop_signals, shared by every runner: a handler takes SIGINT, SIGTERM and SIGHUP
for the length of a run, in the main thread, each unless it is ignored (SIGINT: a background
job's start; SIGHUP: `nohup`); the previous ones are back afterwards. The runners' own tests
(test_runner, test_client, test_server_pool, test_interrupts) press Ctrl-C and send SIGTERM in
both conditions, and hang up."""

import os
import signal
import threading

import pytest

from wan_enhanced.runner.stop_signals import (STOP_SIGNALS, FirstStopRaises, StopSignals,
                                              sigint_ignored)

pytestmark = pytest.mark.skipif(os.name != "posix", reason="POSIX signals")
ALL = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def handler(signum, frame):
    pass


def send(signum):
    """The signal to this process; its Python handler runs before this returns."""
    os.kill(os.getpid(), signum)


def test_a_handler_takes_the_three_signals_for_the_block_and_gives_them_back(
        interactive_sigint, stray_sigterm, stray_sighup):
    assert STOP_SIGNALS == ALL
    seen = []
    with StopSignals(lambda signum, frame: seen.append(signum)) as stop:
        assert stop.taken and stop.signals == ALL
        send(signal.SIGINT)
        send(signal.SIGTERM)
        send(signal.SIGHUP)
    assert seen == list(ALL) and stray_sigterm == [] and stray_sighup == []
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    send(signal.SIGTERM)
    send(signal.SIGHUP)
    # the test's own handlers are back
    assert stray_sigterm == [signal.SIGTERM] and stray_sighup == [signal.SIGHUP]


def test_an_ignored_sigint_stays_ignored_and_sigterm_is_still_taken(ignored_sigint,
                                                                    stray_sigterm, stray_sighup):
    assert sigint_ignored()
    seen = []
    with StopSignals(lambda signum, frame: seen.append(signum)) as stop:
        assert stop.signals == (signal.SIGTERM, signal.SIGHUP)
        assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
        send(signal.SIGINT)
        send(signal.SIGTERM)
    assert seen == [signal.SIGTERM] and stray_sigterm == []
    assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN


def test_an_ignored_sigterm_stays_ignored(interactive_sigint, stray_sighup):
    previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        with StopSignals(handler) as stop:
            assert stop.signals == (signal.SIGINT, signal.SIGHUP)
            assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_a_hangup_under_nohup_stays_ignored(interactive_sigint, stray_sigterm):
    """`nohup wan-enhanced run ...`: the run is meant to outlive its terminal, so a SIGHUP
    ignored at the start stays ignored; Ctrl-C and `kill` still stop it."""
    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        seen = []
        with StopSignals(lambda signum, frame: seen.append(signum)) as stop:
            assert stop.signals == (signal.SIGINT, signal.SIGTERM)
            assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
            send(signal.SIGHUP)
            send(signal.SIGTERM)
        assert seen == [signal.SIGTERM]
        assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, previous)


def test_other_threads_take_nothing(interactive_sigint, stray_sigterm, stray_sighup):
    seen = []
    before = [signal.getsignal(signum) for signum in ALL]

    def run():
        with StopSignals(handler) as stop:
            seen.append((stop.taken, [signal.getsignal(signum) for signum in ALL]))

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert seen == [(False, before)]


def test_an_inner_block_leaves_both_signals_to_the_outer_one(interactive_sigint, stray_sigterm):
    outer, inner = [], []
    with StopSignals(lambda signum, frame: outer.append(signum)):
        with StopSignals(lambda signum, frame: inner.append(signum)) as nested:
            assert not nested.taken
            send(signal.SIGTERM)
        send(signal.SIGINT)
    assert outer == [signal.SIGTERM, signal.SIGINT] and inner == []


def test_the_first_signal_raises_and_later_ones_are_counted(interactive_sigint, stray_sigterm):
    with FirstStopRaises() as stop:
        with pytest.raises(KeyboardInterrupt):
            send(signal.SIGTERM)
        send(signal.SIGINT)  # a cleanup running now is not cut short
        send(signal.SIGTERM)
    assert stop.count == 3 and stop.signum == signal.SIGTERM and stray_sigterm == []


def test_a_first_signal_outside_the_stoppable_parts_raises_at_the_next_one(interactive_sigint,
                                                                           stray_sigterm):
    with FirstStopRaises(anywhere=False) as stop:
        send(signal.SIGTERM)  # while a results line is written: not cut
        assert stop.count == 1
        with pytest.raises(KeyboardInterrupt):
            with stop.stoppable():
                pytest.fail("a stoppable part ran after the signal")
        with stop.stoppable():
            send(signal.SIGTERM)  # raised once already
    assert stop.count == 2 and stray_sigterm == []
