"""The rule of stop_signals, shared by every runner: a handler takes SIGINT and SIGTERM for the
length of a run, in the main thread, each unless it is ignored (SIGINT: a background job's
start); the previous ones are back afterwards. The runners' own tests (test_runner, test_client,
test_server_pool, test_interrupts) press Ctrl-C and send SIGTERM in both conditions."""

import os
import signal
import threading

import pytest

from wan_enhanced.runner.stop_signals import FirstStopRaises, StopSignals, sigint_ignored

BOTH = (signal.SIGINT, signal.SIGTERM)


def handler(signum, frame):
    pass


def send(signum):
    """The signal to this process; its Python handler runs before this returns."""
    os.kill(os.getpid(), signum)


def test_a_handler_takes_both_signals_for_the_block_and_gives_them_back(interactive_sigint,
                                                                        stray_sigterm):
    seen = []
    with StopSignals(lambda signum, frame: seen.append(signum)) as stop:
        assert stop.taken and stop.signals == BOTH
        send(signal.SIGINT)
        send(signal.SIGTERM)
    assert seen == [signal.SIGINT, signal.SIGTERM] and stray_sigterm == []
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    send(signal.SIGTERM)
    assert stray_sigterm == [signal.SIGTERM]  # the test's own handler is back


def test_an_ignored_sigint_stays_ignored_and_sigterm_is_still_taken(ignored_sigint,
                                                                    stray_sigterm):
    assert sigint_ignored()
    seen = []
    with StopSignals(lambda signum, frame: seen.append(signum)) as stop:
        assert stop.signals == (signal.SIGTERM,)
        assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
        send(signal.SIGINT)
        send(signal.SIGTERM)
    assert seen == [signal.SIGTERM] and stray_sigterm == []
    assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN


def test_an_ignored_sigterm_stays_ignored(interactive_sigint):
    previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        with StopSignals(handler) as stop:
            assert stop.signals == (signal.SIGINT,)
            assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_other_threads_take_nothing(interactive_sigint, stray_sigterm):
    seen = []
    before = [signal.getsignal(signum) for signum in BOTH]

    def run():
        with StopSignals(handler) as stop:
            seen.append((stop.taken, [signal.getsignal(signum) for signum in BOTH]))

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
