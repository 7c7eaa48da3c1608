"""`wan-enhanced run --server URL1,URL2,...`: a sweep spread over several ComfyUI servers (one
per GPU, or per group of GPUs), each running one job at a time; a free server takes the next
job, so faster servers take more.

Each server's files download into a folder of its own under --out (named after its host and
port: two servers number their outputs alike). Every finished job appends its line to the
results file as the single-server run does; the job keys do not name the servers, so a rerun
with the same or another set of servers skips what any of them finished.

A server that stops answering is dropped: its job goes back to the others (at most once per server),
and the run goes on while one server is left. A workflow a server rejects stops the run (exit 2).
Ctrl-C, `kill` (SIGTERM) or a hangup (SIGHUP) stops dispatching, asks every server to take our
prompt off its queue or interrupt it (that prompt only, by its id: a shared server keeps running
other users' prompts), records those jobs as interrupted and ends with exit 1; further signals
meanwhile are counted and ignored, so the servers' answers and the results lines are waited for. A
process that started with SIGINT ignored (a background job) keeps ignoring it, SIGTERM still stops
it (see stop_signals).
"""

from __future__ import annotations

import collections
import re
import sys
import threading
import time
import urllib.parse
from pathlib import Path
from typing import Iterable

from .client import Client, PromptRejected, RemoteInterrupted, RemoteRunError, ServerError
from .stop_signals import StopSignals
from .sweep import ResultsLog, SweepJob, result_record

OK, FAILED, INVALID = 0, 1, 2


def server_urls(text: str) -> list[str]:
    """The URLs of a --server value: one, or several separated by commas (no duplicates)."""
    urls = [part.strip() for part in text.split(",") if part.strip()]
    if not urls:
        raise ValueError(f"--server {text!r}: no URL given")
    seen = set()
    for url in urls:
        if url.rstrip("/") in seen:
            raise ValueError(f"--server: {url} is named twice")
        seen.add(url.rstrip("/"))
    return urls


def server_folder(url: str) -> str:
    """A folder name for a server's downloads: its host and port."""
    parts = urllib.parse.urlsplit(url if "://" in url else "http://" + url)
    name = f"{parts.hostname or 'server'}-{parts.port or (443 if parts.scheme == 'https' else 80)}"
    return re.sub(r"[^A-Za-z0-9._-]", "_", name)


class _Pool:

    def __init__(self, clients: list[Client], jobs: Iterable[SweepJob], count: int, total: int,
                 out: Path, results: ResultsLog | None):
        self.clients, self.total, self.out, self.results = clients, total, out, results
        self.jobs = iter(jobs)  # built as servers take them
        self.returned: collections.deque = collections.deque()  # jobs of a dropped server
        self.remaining = count
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.status = OK
        self.alive = len(clients)
        self.tried: dict[int, set[str]] = {}

    def say(self, text: str) -> None:
        with self.lock:
            print(text, file=sys.stderr, flush=True)

    def record(self, record: dict) -> None:
        with self.lock:
            if self.results is not None:
                self.results.append(record)

    def close_results(self) -> None:
        """No line from now on (the run ends; a server still waited for writes none): the file
        is left complete, not cut in a line when the process exits."""
        with self.lock:
            self.results = None

    def serve(self, client: Client) -> None:
        name = client.base
        folder = self.out / server_folder(name)
        while not self.stop.is_set():
            job = self._next()
            if job is None:
                with self.lock:
                    if self.remaining == 0:
                        return
                time.sleep(0.2)  # a job a dropped server gives back may still come
                continue
            if self.stop.is_set():
                return
            self.say(f"[{name}] job {job.index}/{self.total}" + _settings(job))
            started = time.perf_counter()
            try:
                result = client.run(job.workflow, folder)
            except PromptRejected as exc:
                self._finished(job, name, "error", started, exc, INVALID)
                self.stop.set()
                return
            except RemoteRunError as exc:
                self._finished(job, name, "error", started, exc, FAILED)
                continue
            except RemoteInterrupted as exc:
                self._finished(job, name, "interrupted", started, exc, FAILED)
                return
            except ServerError as exc:
                self._drop(client, job, exc)
                return
            self.say(f"[{name}] job {job.index}/{self.total} finished in "
                     f"{result.seconds:.1f} s: {', '.join(result.files) or 'no files'}")
            self.record(result_record(job.job_key, job.settings, status="success",
                                      seconds=result.seconds, files=result.files,
                                      prompt_id=result.prompt_id) | {"server": name})
            self._done()

    def _next(self) -> SweepJob | None:
        with self.lock:
            if self.returned:
                return self.returned.popleft()
            return next(self.jobs, None)

    def _finished(self, job, name, status, started, exc, code) -> None:
        self.say(f"[{name}] job {job.index}/{self.total} "
                 f"{'failed' if status == 'error' else status}: {exc}")
        self.record(result_record(job.job_key, job.settings, status=status,
                                  seconds=time.perf_counter() - started, files=[],
                                  prompt_id=getattr(exc, "prompt_id", None) or "",
                                  error=str(exc)) | {"server": name})
        with self.lock:
            self.status = max(self.status, code)
        self._done()

    def _done(self) -> None:
        with self.lock:
            self.remaining -= 1

    def _drop(self, client: Client, job: SweepJob, exc: ServerError) -> None:
        """This server is gone: its job goes back to the others (once per server)."""
        with self.lock:
            self.alive -= 1
            tried = self.tried.setdefault(job.index, set())
            tried.add(client.base)
            others_left = self.alive > 0 and len(tried) < len(self.clients)
        self.say(f"[{client.base}] dropped: {exc}")
        if others_left:
            with self.lock:
                self.returned.append(job)
            return
        self._finished(job, client.base, "error", time.perf_counter(), exc, FAILED)
        if self.alive == 0:
            self.stop.set()

    def interrupt_all(self) -> None:
        """No more jobs; each server's prompt of ours leaves its queue or stops (only ours:
        a server shared with others keeps running their prompts)."""
        self.stop.set()
        for client in self.clients:
            client.cancel_in_flight()


def run_on_servers(clients: list[Client], jobs: Iterable[SweepJob], count: int, total: int,
                   out: str | Path, results: ResultsLog | None) -> int:
    """`count` of the sweep's `total` jobs to run (`jobs`, taken one at a time)."""
    pool = _Pool(clients, jobs, count, total, Path(out), results)
    threads = [threading.Thread(target=pool.serve, args=(client,), daemon=True,
                                name=f"wan-enhanced-server-{i}")
               for i, client in enumerate(clients)]
    for thread in threads:
        thread.start()
    # Signals are only counted, and read between joins: a KeyboardInterrupt raised inside
    # Thread.join marks the thread joined as finished while it still runs (CPython 3.11), and
    # the joins below would then not wait for its results line.
    with StopSignals() as stop:
        while any(thread.is_alive() for thread in threads):
            if stop.count:  # Ctrl-C (unless SIGINT is ignored) or SIGTERM; later ones: no matter
                pool.say("interrupted: asking every server to stop its prompt")
                pool.interrupt_all()
                for thread in threads:
                    thread.join(timeout=30)
                pool.close_results()
                return FAILED
            for thread in threads:
                thread.join(timeout=0.2)
                if stop.count:
                    break
    if pool.remaining and pool.status == OK:
        pool.say(f"{pool.remaining} job(s) did not run: no server was left")
        return FAILED
    return pool.status


def _settings(job: SweepJob) -> str:
    if not job.settings:
        return ""
    return ": " + "  ".join(f"{k}={v!r}" for k, v in job.settings.items())
