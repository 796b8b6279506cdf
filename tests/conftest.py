"""What every test shares: torch.compile's files go to a folder of this session, removed at its end.

The tests that compile (Chapter 8's CCAE step and RMSProp) would otherwise leave torch's cache in the system's
temporary folder: its compiled code (~10 MB) and, above all, its precompiled C++ headers (~280 MB, written beside
the default cache whatever TORCHINDUCTOR_CACHE_DIR says). Here the cache is the session's and no header is
precompiled (each kernel compiles its includes instead: the same code, compiled somewhat slower). Whoever sets
TORCHINDUCTOR_CACHE_DIR keeps torch's cache there between runs, headers included: the compiled tests then load what
the last run compiled."""
import os
import shutil
import tempfile

import pytest


@pytest.fixture(scope="session", autouse=True)
def compile_cache_of_this_session():
    if os.environ.get("TORCHINDUCTOR_CACHE_DIR"):
        yield os.environ["TORCHINDUCTOR_CACHE_DIR"]
        return
    before = os.environ.get("TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS")
    folder = tempfile.mkdtemp(prefix="capsule_book_inductor_")
    # read by torch when it first compiles (after this), and by the processes the tests start
    os.environ.update(TORCHINDUCTOR_CACHE_DIR=folder, TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS="0")
    yield folder
    os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
    if before is None: os.environ.pop("TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS", None)
    else: os.environ["TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS"] = before
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="session", autouse=True)
def ctrl_c_deliverable():
    """The Ctrl-C tests send SIGINT to themselves or to the processes they start; a shell that runs a job in the
    background with nohup (or without job control) starts it with SIGINT ignored, and the children inherit that.
    Python's own handler is put in its place for the session (the children then start with the default)."""
    import signal
    before = signal.getsignal(signal.SIGINT)
    if before is signal.SIG_IGN: signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)
