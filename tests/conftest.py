from pathlib import Path

import pytest

GOLDEN = Path(__file__).parent / "golden"


def pytest_addoption(parser):
    parser.addoption("--gpu", action="store_true", help="run the tests that need a CUDA device")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--gpu"):
        return
    skip = pytest.mark.skip(reason="GPU test: run with --gpu on a CUDA machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def golden_dir() -> Path:
    return GOLDEN


# -- folders nothing can be written into, also for root ------------------------------------------

def _make_unwritable(folder: Path):
    """Lock `folder` against writes and return a function that unlocks it, or None when this
    machine cannot: chmod stops ordinary users, root needs the immutable flag (chattr +i)."""
    import os
    import shutil
    import subprocess

    if os.name != "posix":
        return None
    if os.geteuid() != 0:
        folder.chmod(0o555)
        return lambda: folder.chmod(0o755)
    chattr = shutil.which("chattr")
    if chattr is None or subprocess.run([chattr, "+i", str(folder)],
                                        capture_output=True).returncode != 0:
        return None
    return lambda: subprocess.run([chattr, "-i", str(folder)], capture_output=True)


@pytest.fixture(params=["read-only", "under-a-file"])
def unwritable_folder(request, tmp_path):
    """A folder path into which no file can be written: an existing folder locked against writes
    (chmod, or chattr +i as root), or a path below a regular file (mkdir fails with
    NotADirectoryError everywhere). Skips only the locked kind where no lock is available."""
    if request.param == "under-a-file":
        blocker = tmp_path / "a-file"
        blocker.write_text("not a folder")
        yield blocker / "out"
        return
    folder = tmp_path / "locked"
    folder.mkdir()
    unlock = _make_unwritable(folder)
    if unlock is None:
        pytest.skip("no way to lock a folder here (no chattr for root, or not POSIX)")
    try:
        yield folder
    finally:
        unlock()


# -- worker groups of gloo processes (the several-GPU code on the CPU) ---------------------------

@pytest.fixture(scope="session")
def gloo_group():
    """gloo_group(world): a warm group of `world` CPU worker processes, shared by the session's
    tests (a test that breaks its group gets a fresh one next time)."""
    from wan_enhanced.distributed.group import WorkerGroup

    groups = {}

    def get(world: int):
        group = groups.get(world)
        if group is None or not group.alive:
            group = groups[world] = WorkerGroup(world, "cpu", start_timeout_s=120).start()
        return group

    yield get
    for group in groups.values():
        group.shutdown()


@pytest.fixture(scope="session")
def ti2v_models(tmp_path_factory) -> Path:
    """A tiny Wan2.2 TI2V-5B models folder (tiny_sets.DIT, VAE, TE), written once."""
    from tiny_sets import write_ti2v_set
    return write_ti2v_set(tmp_path_factory.mktemp("ti2v_models"))


@pytest.fixture(scope="session")
def all_kinds_models(tmp_path_factory) -> Path:
    """A tiny models folder with every kind (tiny_sets.NAMES), written once."""
    from tiny_sets import write_all_kinds
    return write_all_kinds(tmp_path_factory.mktemp("all_kinds_models"))


# -- SIGINT as an interactive run or a background job gets it; SIGTERM sent by a test ------------

def _sigint_for_the_test(handler):
    import signal

    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


@pytest.fixture
def interactive_sigint():
    """SIGINT as a process started from a terminal has it (Python's KeyboardInterrupt handler),
    whatever pytest started with: `pytest &` in a script starts with SIGINT ignored."""
    import signal
    yield from _sigint_for_the_test(signal.default_int_handler)


@pytest.fixture
def ignored_sigint():
    """SIGINT as a background job starts with it (`cmd &` in a non-interactive shell): ignored."""
    import signal
    yield from _sigint_for_the_test(signal.SIG_IGN)


@pytest.fixture
def stray_sighup():
    """As stray_sigterm, for SIGHUP (the terminal hung up): each SIGHUP no runner took is noted
    in the list yielded; SIGHUP is not ignored during the test, whatever pytest started with
    (under `nohup` it starts ignored)."""
    import signal

    seen = []
    previous = signal.signal(signal.SIGHUP, lambda signum, frame: seen.append(signum))
    try:
        yield seen
    finally:
        signal.signal(signal.SIGHUP, previous)


@pytest.fixture
def stray_sigterm():
    """For tests that send SIGTERM to their own process: a handler that notes each SIGTERM no
    runner took (the list yielded) instead of Python's default, which would end pytest; such a
    test then fails on its outcome instead."""
    import signal

    seen = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: seen.append(signum))
    try:
        yield seen
    finally:
        signal.signal(signal.SIGTERM, previous)

