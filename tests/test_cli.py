"""The command line: `gdnviz inspect` and `gdnviz capture` in a subprocess on a tiny checkpoint."""
import json
import os
import subprocess
import sys

import numpy as np

from checkpoints import tiny_qwen35_checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(*args):
    env = dict(os.environ, PYTHONPATH=ROOT)
    return subprocess.run([sys.executable, "-m", "gdnviz", *args], capture_output=True, text=True, env=env,
                          timeout=600)


def test_inspect_and_capture(tmp_path):
    ckpt = tiny_qwen35_checkpoint(tmp_path)
    r = run("inspect", str(ckpt))
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["family"] == "qwen3_5"
    doc = tmp_path / "doc.txt"
    doc.write_text("The special magic number is 1234567. " * 40)
    r = run("capture", str(ckpt), str(doc), "--out", str(tmp_path / "out"), "--segment-len", "64")
    assert r.returncode == 0, r.stderr
    from gdnviz.capture import CaptureResult

    cap = CaptureResult.load(tmp_path / "out" / "doc.capture.npz")
    assert cap.meta["segment_len"] == 64 and cap.sv.shape[1:] == (3, 4, 16)
    assert (tmp_path / "out" / "summary.csv").exists()
    ov = json.loads((tmp_path / "out" / "overview.json").read_text())
    assert 0 <= ov["share_forgetting_within_segment"] <= 1 and np.isfinite(ov["erank_median"])


def test_cli_errors_are_messages_not_tracebacks(tmp_path):
    r = run("inspect", str(tmp_path))
    assert r.returncode == 2 and "NotAModelDirectory" in r.stderr and "Traceback" not in r.stderr
    ckpt = tiny_qwen35_checkpoint(tmp_path)
    bad = tmp_path / "bin.txt"
    bad.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00binary")
    r = run("capture", str(ckpt), str(bad), "--out", str(tmp_path / "o"))
    assert r.returncode == 2 and "NotText" in r.stderr and "Traceback" not in r.stderr


def test_capture_via_the_worker_lands_in_the_apps_store(tmp_path):
    """`--via-worker`: the job goes through the store to a real worker process; the run is a previous run."""
    from gdnviz.capture import CaptureResult
    from gdnviz.store import Store

    ckpt = tiny_qwen35_checkpoint(tmp_path)
    doc = tmp_path / "story.txt"
    doc.write_text("Once upon a time the sky was blue and the grass was green. " * 30)
    cache = tmp_path / "cache"
    r = run("capture", str(ckpt), str(doc), "--out", str(tmp_path / "o"), "--segment-len", "64", "--via-worker",
            "--cache-dir", str(cache))
    assert r.returncode == 0, r.stderr
    cap = CaptureResult.load(tmp_path / "o" / "story.capture.npz")
    assert cap.meta["segment_len"] == 64 and (tmp_path / "o" / "summary.csv").exists()
    runs = Store(cache).list_runs()
    assert len(runs) == 1 and runs[0]["documents"][0]["name"] == "story.txt"
    assert runs[0]["documents"][0]["n_tokens"] == cap.n_tokens
