"""The model fingerprint (memo keys) changes whenever the weights change: whole weight files are hashed, once per
(path, size, mtime_ns, ctime_ns); a changed checkpoint is never served the results of the old one."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

from app_fixtures import short_text
from gdnviz import jobs
from gdnviz.models import filehash
from gdnviz.models.loader import DEMO_DIR, fingerprint
from gdnviz.store import Store

MiB = 2 ** 20


def _demo_copy(tmp_path) -> Path:
    out = tmp_path / "demo-copy"
    shutil.copytree(DEMO_DIR, out)
    return out


def _overwrite_middle(weights: Path, n_bytes: int = 4 * MiB) -> None:
    """Halve n_bytes of bf16 weights in the middle of the file, in place: same size, same mtime (restored, as
    ``cp -p`` or ``rsync -t`` would leave it), other values."""
    st = weights.stat()
    start = (st.st_size // 2) & ~1023  # inside the tensor data, on a bf16 boundary
    with open(weights, "r+b") as fh:
        fh.seek(start)
        old = bytearray(fh.read(n_bytes))
        new = (torch.frombuffer(old, dtype=torch.bfloat16) * 0.5).contiguous().view(torch.uint8).numpy().tobytes()
        assert new != bytes(old) and len(new) == n_bytes
        fh.seek(start)
        fh.write(new)
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert weights.stat().st_size == st.st_size and weights.stat().st_mtime_ns == st.st_mtime_ns


def test_four_mib_overwritten_in_the_middle_changes_the_fingerprint(tmp_path, monkeypatch):
    monkeypatch.setenv("GDNVIZ_CACHE_DIR", str(tmp_path / "cache"))
    ck = _demo_copy(tmp_path)
    before = fingerprint(ck)
    assert fingerprint(ck) == before
    _overwrite_middle(ck / "model.safetensors")
    assert fingerprint(ck) != before


def test_a_weight_file_is_hashed_once_per_version(tmp_path, monkeypatch):
    """The whole-file hash is remembered on disk by path, size and times: later fingerprints only stat the file."""
    monkeypatch.setenv("GDNVIZ_CACHE_DIR", str(tmp_path / "cache"))
    ck = _demo_copy(tmp_path)
    read = []
    real = filehash.sha256_of_file
    monkeypatch.setattr(filehash, "sha256_of_file", lambda p: read.append(p) or real(p))
    fp = fingerprint(ck)
    assert [Path(p).name for p in read] == ["model.safetensors"]
    assert fingerprint(ck) == fp and len(read) == 1  # remembered (in the cache directory, across processes)
    assert (tmp_path / "cache" / "filehash").is_dir()
    _overwrite_middle(ck / "model.safetensors")
    assert fingerprint(ck) != fp and len(read) == 2  # a new version of the file is hashed again
    assert real(ck / "model.safetensors") == filehash.file_sha256(ck / "model.safetensors")


def test_a_changed_checkpoint_gets_no_stored_capture_of_the_old_one(tmp_path, monkeypatch):
    """Capture, overwrite 4 MiB of weights (size and mtime unchanged), capture again in the same worker: nothing is
    reused, the run and its states are new."""
    from gdnviz.worker import Worker

    monkeypatch.setenv("GDNVIZ_CACHE_DIR", str(tmp_path / "cache"))
    ck = _demo_copy(tmp_path)
    store = Store(tmp_path / "cache")
    w = Worker(store)
    spec = jobs.spec_to_dict(jobs.CaptureJob(model=str(ck), documents=(("doc", short_text(120, 3)),),
                                             segment_len=64))

    def capture() -> dict:
        jid = store.submit("capture", spec)
        w.run_pending()
        rec = store.job(jid)
        assert rec["status"] == "done", rec["error"]
        return rec["result"]

    first = capture()
    assert capture()["reused"] == 1  # unchanged weights: read back
    _overwrite_middle(ck / "model.safetensors")
    again = capture()
    assert again["reused"] == 0 and again["computed"] == 1 and again["run_id"] != first["run_id"]
    a, b = (jobs.load_run_captures(store, store.run(r["run_id"]))[0] for r in (first, again))
    assert a.sv.shape == b.sv.shape and not (a.sv == b.sv).all()
