"""The command line: `gdnviz inspect`, `gdnviz capture` and `gdnviz sweep --via-worker` in a subprocess on a tiny
checkpoint."""
import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

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


@pytest.mark.slow
def test_sweep_via_the_worker_writes_what_the_direct_path_writes(tmp_path, capsys, monkeypatch):
    """`sweep --via-worker`: submitted through the store to a worker it starts, progress bar, then the same rows.csv
    and table.csv as the direct path (same model, same batches); the samples are memoised in the app's store."""
    import pandas as pd

    from gdnviz.cli import main
    from gdnviz.store import Store

    ckpt = tiny_qwen35_checkpoint(tmp_path)
    common = ["sweep", str(ckpt), "--tasks", "niah_single_1", "--lengths", "400", "--ranks", "2", "--n", "2",
              "--batch", "2", "--max-new-tokens", "6", "--segment-len", "128", "--heads", "layers:1",
              "--device", "cpu", "--dtype", "float32"]
    cache = tmp_path / "cache"
    monkeypatch.setenv("PYTHONPATH", ROOT)  # for the worker process the CLI starts
    assert main([*common, "--out", str(tmp_path / "w"), "--via-worker", "--cache-dir", str(cache)]) == 0
    err = capsys.readouterr().err
    assert "sweep (via worker)" in err and "4 samples computed, 0 from the memo" in err
    w = tmp_path / "w"
    assert {p.name for p in w.iterdir()} == {"rows.csv", "table.csv", "figure.png", "settings.json"}
    assert (w / "figure.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    jobs_ = [j for j in Store(cache).jobs.iterkeys() if str(j).startswith("job:")]
    assert len(jobs_) == 1  # one job, through the store
    settings = json.loads((w / "settings.json").read_text())
    assert settings["spec"]["heads"] == "layers:1" and settings["model"]["fingerprint"]

    assert main([*common, "--out", str(tmp_path / "d")]) == 0  # the direct path, in process
    assert "sweep: 4 answers, 0 in the memo, 4 to run; no estimate yet" in capsys.readouterr().err
    assert main([*common, "--out", str(tmp_path / "d")]) == 0  # again: the memo holds them, at a measured rate
    assert "sweep: 4 answers, 4 in the memo, 0 to run; nothing to generate" in capsys.readouterr().err
    d = tmp_path / "d"
    assert (w / "rows.csv").read_text() == (d / "rows.csv").read_text()
    assert (w / "table.csv").read_text() == (d / "table.csv").read_text()
    assert len(pd.read_csv(w / "rows.csv")) == 4
    capsys.readouterr()
    # bad input through a worker (a live one on the store, here in a thread of this process): its message
    import threading

    from gdnviz.worker import Worker

    w = Worker(Store(cache))
    w.beat()  # a heartbeat: the CLI uses this worker instead of starting one

    def serve_one():
        while not w.run_pending(max_jobs=1):
            time.sleep(0.05)

    t = threading.Thread(target=serve_one, daemon=True)
    t.start()
    assert main([*common[:-4], "--ranks", "4,64", "--out", str(tmp_path / "x"), "--via-worker", "--cache-dir",
                 str(cache)]) == 2
    t.join(60)
    w.store.worker_gone(w.pid)
    err = capsys.readouterr().err
    assert "RankOutOfRange" in err and "rank 64 is outside 1..16" in err and "Traceback" not in err


def test_sweep_outputs_without_altair_keep_the_csvs(tmp_path, capsys, monkeypatch):
    """A machine without altair (the H200 image has none) still gets rows.csv/table.csv and a message, not an
    exit with a traceback after the whole sweep ran (as once seen on the H200)."""
    import pandas as pd

    from gdnviz.cli import _write_sweep_outputs

    monkeypatch.setitem(sys.modules, "altair", None)  # `import altair` raises ImportError
    rows = pd.DataFrame([dict(task="vt", length=512, setting="uniform", r=1, seed=0, score=100.0, pred=" A",
                              answers='["A"]', n_tokens=500, n_generated=2)])
    table = pd.DataFrame([dict(task="vt", length=512, setting="uniform", r=1, score=100.0, n=1, untouched=100.0,
                               delta=0.0, se=0.0)])
    _write_sweep_outputs(tmp_path, rows, table, {"spec": {}}, "tiny")
    assert {p.name for p in tmp_path.iterdir()} == {"rows.csv", "table.csv", "settings.json"}
    assert "figure.png not written" in capsys.readouterr().err


def test_loss_writes_both_copy_subsets_and_resumes(tmp_path, capsys):
    """`gdnviz loss`: loss.csv holds every r on all predictions and on both copy subsets (copy_any, copy_recent),
    loss_documents.csv one row per document and setting; the same command again computes nothing; bad input is a
    message (exit 2), not a traceback."""
    import pandas as pd

    from gdnviz.cli import main

    ckpt = tiny_qwen35_checkpoint(tmp_path)
    docs = []
    for i, text in enumerate(("the cat sat on the mat and the dog sat on the log. " * 12,
                              "one two three four five six seven eight nine ten. " * 10)):
        docs.append(tmp_path / f"d{i}.txt")
        docs[-1].write_text(text)
    args = ["loss", str(ckpt), *map(str, docs), "--ranks", "2", "--segment-len", "64", "--min-distance", "40",
            "--device", "cpu", "--dtype", "float32", "--out", str(tmp_path / "o")]
    assert main(args) == 0
    assert "4 (document, setting) runs computed, 0 from the memo" in capsys.readouterr().err
    o = tmp_path / "o"
    assert {p.name for p in o.iterdir()} == {"loss.csv", "loss_documents.csv", "figure.png", "settings.json",
                                             "cache"}
    t = pd.read_csv(o / "loss.csv")
    assert t["r"].tolist() == [2, 2, 2, 16, 16, 16]
    assert t["subset"].tolist() == ["all", "copy_any", "copy_recent"] * 2
    # periodic text: every bigram was seen more than 40 tokens back, but always also one period (< 40) back, so
    # the strict reading is empty (no documents, no numbers) while the other holds most predictions
    assert t["n_docs"].tolist() == [2, 2, 0, 2, 2, 0] and t.loc[t.n_docs == 0, "loss"].isna().all()
    assert (t.loc[t.r == 16, ["delta", "se"]].iloc[:2] == 0).all().all()
    rows = pd.read_csv(o / "loss_documents.csv")
    assert len(rows) == 4 and (rows["n_copy_recent"] == 0).all() and (rows["n_copy_any"] > 0).all()
    assert json.loads((o / "settings.json").read_text())["spec"]["min_distance"] == 40
    assert main(args) == 0
    assert "0 (document, setting) runs computed, 4 from the memo" in capsys.readouterr().err
    assert pd.read_csv(o / "loss.csv").equals(t)
    assert main([*args[:-2], "--out", str(tmp_path / "x"), "--ranks", "17"]) == 2
    err = capsys.readouterr().err
    assert "RankOutOfRange" in err and "rank 17 is outside 1..16" in err
    assert main([*args[:-2], "--out", str(tmp_path / "x"), "--segment-len", "4096"]) == 2
    assert "DocumentTooShort" in capsys.readouterr().err


def test_patch_writes_the_comparison_and_refuses_bad_heads(tmp_path, capsys):
    """`gdnviz patch demo --needle`: comparison.csv (A, B, B patched per pair) agrees with patch.json, states.csv
    has one row per patched head, a rerun comes from the memo; a full-attention layer is a message (exit 2)."""
    import pandas as pd

    from gdnviz.cli import main
    from gdnviz.patching.compare import COMPARISON_COLUMNS

    base = ["patch", "demo", "--needle", "niah_single_1", "--length", "700", "--seed0", "3", "--segment-len", "128",
            "--max-new-tokens", "8", "--device", "cpu", "--dtype", "float32", "--out", str(tmp_path / "o")]
    assert main([*base, "--heads", "layers:5"]) == 0
    t = pd.read_csv(tmp_path / "o" / "comparison.csv", dtype={"answer": str})
    assert list(t.columns) == ["pair", "boundary", "source", *COMPARISON_COLUMNS, "b_question", "needles"]
    assert t["run"].tolist() == ["A", "B", "B patched"] and set(t["pair"]) == {"seed 3"}
    res = json.loads((tmp_path / "o" / "patch.json").read_text())["results"][0]
    assert t["answer"].tolist() == [res["answers"][k]["text"] for k in ("A", "B", "B patched")]
    assert t["delta_loss"].iloc[2] == pytest.approx(res["loss"]["delta"], rel=1e-9)
    assert t["boundary"].iloc[0] == res["boundary"] == (res["meta"]["b_question"] // 128) * 128
    s = pd.read_csv(tmp_path / "o" / "states.csv")
    assert s[["layer", "head"]].values.tolist() == [[5, 0], [5, 1]]
    assert "(memo)" not in capsys.readouterr().err
    assert main([*base, "--heads", "layers:5"]) == 0
    assert "(memo)" in capsys.readouterr().err
    assert main([*base, "--heads", "3:0,5:1"]) == 2
    assert "LayerNotGDN: layer 3 (a full-attention layer)" in capsys.readouterr().err


@pytest.mark.slow
def test_ctrl_c_on_sweep_via_worker_cancels_the_job_even_when_the_worker_must_exit_to_stop_it(tmp_path):
    """Ctrl-C (SIGINT to the CLI alone; the worker it started is in its own session) while the worker is stuck
    building prompts (the GDNVIZ_TEST_STALL_AT hook: a step that never returns): the CLI cancels through the store,
    the worker's cancel watcher answers the job "cancelled" and exits, and the CLI reports the cancel, not a crash."""
    import signal

    from gdnviz.store import CANCEL_EXIT_CODE, Store

    ckpt = tiny_qwen35_checkpoint(tmp_path)
    cache = tmp_path / "cache"
    env = dict(os.environ, PYTHONPATH=ROOT, GDNVIZ_TEST_STALL_AT="generating RULER prompts")
    p = subprocess.Popen([sys.executable, "-m", "gdnviz", "sweep", str(ckpt), "--tasks", "niah_single_1",
                          "--lengths", "400", "--ranks", "2", "--n", "2", "--batch", "2", "--max-new-tokens", "6",
                          "--segment-len", "128", "--device", "cpu", "--dtype", "float32", "--out",
                          str(tmp_path / "o"), "--via-worker", "--cache-dir", str(cache)],
                         env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    store = Store(cache)
    try:
        t0 = time.time()
        while True:
            assert time.time() - t0 < 300 and p.poll() is None, "the job never reached its prompts"
            recs = store.read_jobs()[0]
            if recs and "generating RULER prompts" in str((store.job(recs[0]["id"])["progress"] or {}).get("text")):
                break
            time.sleep(0.1)
        jid = recs[0]["id"]
        p.send_signal(signal.SIGINT)
        err = p.communicate(timeout=60)[1]
        rec = store.job(jid)
        assert p.returncode == 2, err
        assert rec["status"] == "cancelled" and "the worker was restarted to stop it mid-run" in rec["error"]
        assert f"interrupted: cancelling job {jid}" in err and "sweep cancelled: cancelled by the user; it did " \
            "not stop within 3 s" in err and "Traceback" not in err, err
        log = store.log_path.read_text()
        assert f"exiting with code {CANCEL_EXIT_CODE} to stop it" in log, log[-2000:]
    finally:
        if p.poll() is None:
            p.kill()
        for h in store.live_workers():  # the worker it started, left stuck by a failed assertion
            os.kill(h["pid"], signal.SIGKILL)
