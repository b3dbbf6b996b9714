"""App side of the worker: start it once per Streamlit server, watch it, restart it when it dies.

``WorkerHandle.check()`` is called on every page run and every poll: when the child process has exited it fails
the job that worker was running ("the worker process died while running this job (exit code N); it has been
restarted"), starts a new worker and counts the restart. A worker that beats but is not our child (a worker
started from the CLI on the same cache directory) is used as is.

``make_handle(store)`` is called once per Streamlit server (``gdnviz.ui.common.ensure_worker`` caches it with
``st.cache_resource``). ``GDNVIZ_NO_WORKER=1`` disables starting one (AppTest runs jobs in-process with
``Worker.run_pending``). The worker gets ``--parent-pid`` so that it exits when the server does, even on SIGKILL.
"""
from __future__ import annotations

import atexit
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from gdnviz import settings
from gdnviz.store import ROOT, Store, describe_exit, pid_alive


class WorkerHandle:
    """The worker process this Streamlit server started (or None when disabled)."""

    def __init__(self, store: Store, enabled: bool = True):
        self.store = store
        self.enabled = enabled
        self.proc: subprocess.Popen | None = None
        self.restarts = 0
        self.last_exit: str | None = None
        self.started_at: float | None = None
        self._lock = threading.Lock()
        self._log = None

    def start(self) -> None:
        if not self.enabled:
            return
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep)
                                                           if p])
        env.setdefault("PYTHONUNBUFFERED", "1")
        self._log = open(self.store.log_path, "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "gdnviz.worker", "--cache-dir", str(self.store.dir), "--parent-pid",
             str(os.getpid())], cwd=str(ROOT), env=env, stdout=self._log, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL)
        self.started_at = time.time()

    def stop(self, timeout: float = 5.0) -> None:
        p = self.proc
        if p is not None and p.poll() is None:
            p.terminate()
            try:
                p.wait(timeout)
            except subprocess.TimeoutExpired:
                p.kill()
        if self._log is not None:
            self._log.close()
            self._log = None

    def check(self) -> dict:
        """Restart a dead worker (failing its job); returns the status for the sidebar."""
        with self._lock:
            if self.enabled:
                if self.proc is not None and self.proc.poll() is not None:
                    code = self.proc.returncode
                    self.last_exit = describe_exit(code)
                    self.store.reap_worker(self.proc.pid, code, restarted=True)
                    self.restarts += 1
                    self.proc = None
                    self.start()
                elif self.proc is None and not self.store.live_workers():
                    # no child of ours and no other live worker (a CLI worker that went away): start one
                    self.store.reap_dead(restarted=True)
                    self.start()
        return self.status()

    def status(self) -> dict:
        """state: 'disabled' | 'starting' | 'idle' | 'busy' | 'not responding'; plus pid, model, job, restarts."""
        live = self.store.live_workers()
        mine = self.proc.pid if self.proc is not None else None
        hb = next((h for h in live if h.get("pid") == mine), live[0] if live else None)
        out = dict(pid=mine, restarts=self.restarts, last_exit=self.last_exit, heartbeat=hb,
                   queued=self.store.queued_count())
        if not self.enabled and hb is None:
            out["state"] = "disabled"
        elif hb is None:
            alive = mine is not None and pid_alive(mine)
            age = time.time() - (self.started_at or time.time())
            if alive and age < 120:
                out["state"] = "starting"
            else:
                out["state"] = "not responding" if alive else "stopped"
        else:
            out["pid"] = hb.get("pid")
            st = str(hb.get("state", ""))
            out["state"] = "busy" if (hb.get("job") or st.startswith(("running", "loading"))) else \
                "starting" if st.startswith("starting") else "idle"
            out["detail"] = st
            out["model"] = hb.get("model")
        return out


def worker_enabled() -> bool:
    return not settings.get("GDNVIZ_NO_WORKER")


def make_handle(store: Store) -> WorkerHandle:
    """A handle for this server process: starts a worker unless one is alive on this cache directory already
    (or ``GDNVIZ_NO_WORKER`` is set); it is stopped when the server exits."""
    enabled = worker_enabled()
    h = WorkerHandle(store, enabled=enabled)
    if enabled:
        store.reap_dead(restarted=False)
        if not store.live_workers():
            h.start()
        atexit.register(h.stop)
    return h
