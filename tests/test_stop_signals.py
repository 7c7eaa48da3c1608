"""The rule of stop_signals, shared by every runner: a handler takes SIGINT for the length of a
run, in the main thread, unless SIGINT is ignored (a background job's start); the previous one is
back afterwards. The runners' own tests (test_runner, test_client, test_server_pool,
test_interrupts) press Ctrl-C in both conditions."""

import signal
import threading

from wan_enhanced.runner.stop_signals import StopSignals, sigint_ignored


def handler(signum, frame):
    pass


def test_a_handler_takes_sigint_for_the_block_and_gives_it_back(interactive_sigint):
    assert not sigint_ignored()
    with StopSignals(handler) as stop:
        assert stop.taken and signal.getsignal(signal.SIGINT) is handler
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_an_ignored_sigint_stays_ignored(ignored_sigint):
    assert sigint_ignored()
    with StopSignals(handler) as stop:
        assert not stop.taken and signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN


def test_other_threads_take_nothing(interactive_sigint):
    seen = []

    def run():
        with StopSignals(handler) as stop:
            seen.append((stop.taken, signal.getsignal(signal.SIGINT)))

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert seen == [(False, signal.default_int_handler)]
