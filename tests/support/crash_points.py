"""Kill a real worker process right after its k-th store write, for every k: a test tool
(tests/test_worker_crash_points.py); the worker itself never imports it.

    python tests/support/crash_points.py        then, on stdin, lines "K CACHE_DIR"

For each line it forks a child that runs the worker's own entry point (``gdnviz.worker.main`` with
``--exit-when-idle``) on CACHE_DIR and SIGKILLs itself right after the K-th *store write* of its main thread,
counted from its first write to the job queue or the job records (taking a job off the queue). A store write is
one outermost mutating diskcache call (set, delete, pop, push, pull, add, incr, or a whole ``transact`` block):
one sqlite transaction, which a kill either commits in full or not at all. So the points "after write k" for
k = 1, 2, ... are every instant at which the worker can die, up to where it exits on its own. The reply is one
line "PID CODE WRITES WHAT": CODE as ``subprocess.Popen.returncode`` (-9 when the kill fired, 0 when the worker
ran out of work first), WRITES the writes counted, WHAT the last one ("jobs: set progress:", "memo: set ?",
"jobs: transaction [pull queue-, set job:, set running:]"; "-" when it exited on its own). torch and
transformers are imported once, before any fork.
"""
from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from pathlib import Path

MUTATING = ("set", "delete", "pop", "push", "pull", "add", "incr")


def _key(key) -> str:
    """A key as the docs name it: 'job:<id>' -> 'job:', 'queue-500000000000000' -> 'queue-'."""
    if not isinstance(key, str):
        return "?"
    for sep in (":", "-"):
        if sep in key:
            return key.split(sep, 1)[0] + sep
    return key


def _describe(name: str, a: tuple, kw: dict) -> str:
    """'set job:', 'pull queue-', 'pop run-': the method and the kind of key it wrote."""
    if name in ("push", "pull"):
        prefix = kw.get("prefix")
        return f"{name} {prefix}-" if prefix else name
    return f"{name} {_key(a[0] if a else kw.get('key'))}"


def _install(kill_after: int, counted: list, report_fd: int) -> None:
    """Wrap diskcache.Cache's mutating methods so that the main thread dies right after write ``kill_after``,
    having written "K<TAB>what the write was" to ``report_fd``."""
    import diskcache

    state = threading.local()
    main = threading.main_thread()

    def after_write(cache, what: str) -> None:
        if threading.current_thread() is not main:
            return
        area = Path(cache.directory).name
        if not counted and area not in ("queue", "jobs"):
            return  # start-up writes (heartbeats) happen before any job is taken
        counted.append(f"{area}: {what}")
        if len(counted) >= kill_after:
            os.write(report_fd, f"{len(counted)}\t{counted[-1]}".encode())
            os.kill(os.getpid(), signal.SIGKILL)

    def enter():
        state.depth = getattr(state, "depth", 0) + 1
        if state.depth == 1:
            state.inner = []

    def wrap(name, fn):
        def inner(self, *a, **kw):
            enter()
            try:
                out = fn(self, *a, **kw)
            finally:
                state.depth -= 1
            what = _describe(name, a, kw)
            if state.depth == 0:
                after_write(self, what)
            else:
                state.inner.append(what)
            return out
        return inner

    for name in MUTATING:
        setattr(diskcache.Cache, name, wrap(name, getattr(diskcache.Cache, name)))
    transact = diskcache.Cache.transact

    @contextlib.contextmanager
    def transact_counted(self, *a, **kw):
        enter()
        try:
            with transact(self, *a, **kw):
                yield
        finally:
            state.depth -= 1
        if state.depth == 0:
            after_write(self, "transaction [" + ", ".join(dict.fromkeys(state.inner)) + "]")

    diskcache.Cache.transact = transact_counted


def _child(kill_after: int, cache_dir: str, report_fd: int) -> None:
    counted: list = []
    _install(kill_after, counted, report_fd)
    # the machine-wide caches under $GDNVIZ_CACHE_DIR (the weight files' hashes) start empty at every point, so the
    # worker makes the same writes in every run, whatever earlier runs left there
    os.environ["GDNVIZ_CACHE_DIR"] = cache_dir
    from gdnviz import worker

    try:
        worker.main(["--cache-dir", cache_dir, "--exit-when-idle", "--poll", "0.05"])
    finally:
        os.write(report_fd, f"{len(counted)}\t-".encode())
        os._exit(0)


def main() -> int:
    import gdnviz.jobs  # noqa: F401  (the worker's imports, paid once)
    import gdnviz.models.loader as loader
    import torch  # noqa: F401
    import transformers  # noqa: F401

    loader._register_fla()
    print("ready", flush=True)
    for line in sys.stdin:
        k, cache_dir = line.split(maxsplit=1)
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            _child(int(k), cache_dir.strip(), w)
        os.close(w)
        _, status = os.waitpid(pid, 0)
        writes, what = os.read(r, 4096).decode().split("\t", 1)
        os.close(r)
        code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        print(pid, code, writes, what, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
