"""The Dask executor of probes (gdnviz.cluster) on a real local cluster of two CPU worker processes (one cluster for
the module), bundled demo model: a sweep's, a scan's and a loss sweep's rows and a budget search's result as in one
process, resume from the store, a worker killed mid-sweep, the CLI's and the app worker's jobs on the cluster, and
the clear refusals."""
import dataclasses
import os
import signal

import pytest

distributed = pytest.importorskip("distributed")

from gdnviz import cluster  # noqa: E402
from gdnviz.errors import ClusterError  # noqa: E402
from gdnviz.probes import sweep  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def client():
    c = cluster.connect("local", workers=2)
    c.wait_for_workers(2, timeout=120)
    yield c
    for other in list(cluster._CLIENTS.values()):  # the clients the CLI and the jobs opened on its address
        if other is not c:
            other.close()
    c.close()
    c.cluster.close() if hasattr(c, "cluster") and c.cluster is not None else None


@pytest.fixture(scope="module")
def lm():
    from gdnviz.models import load

    return load("demo", device="cpu", dtype="float32")


def spec_for(lm, **kw):
    d = dict(model="demo", fingerprint=lm.info.fingerprint, tasks=("niah_single_1",), lengths=(1024,),
             ranks=(1,), n=3, batch_size=2, segment_len=256)
    d.update(kw)
    return sweep.SweepSpec(**d)


def test_cluster_rows_equal_one_process_and_resume(client, lm, tmp_path):
    spec = spec_for(lm)
    ex = cluster.executor(client, "demo", device="cpu", dtype="float32")
    assert ex.info.fingerprint == lm.info.fingerprint and len(ex.workers) == 2
    view = ex.model_view()
    rows = sweep.run_sweep(view, spec, store=tmp_path / "memo", executor=ex)
    local = sweep.run_sweep(lm, spec)
    assert len(rows) == 2 * 3
    assert rows.to_dict("records") == local.to_dict("records")
    assert sum(ex.per_worker.values()) == len(rows)  # every sample answered once, on the cluster
    # the client alone wrote the store: a rerun computes nothing
    again = cluster.executor(client, "demo", device="cpu", dtype="float32")
    rows2 = sweep.run_sweep(view, spec, store=tmp_path / "memo", executor=again)
    assert rows2.to_dict("records") == rows.to_dict("records") and not again.per_worker


def test_a_sweep_without_a_batch_size_takes_the_workers_choice(client, lm):
    """batch_size=None on a cluster: the rows per batch are the executor's ``batch_size`` (the smallest
    ``auto_batch_size`` its workers choose on their own devices: CPU_ROWS on these CPU workers), not a number fixed
    in this process."""
    from gdnviz.probes.batch_size import CPU_ROWS

    ex = cluster.executor(client, "demo", device="cpu", dtype="float32")
    assert ex.batch_size(1024, 32) == CPU_ROWS
    sizes = []

    class Recording:  # the cluster executor with a batch size of 2, recording the units it is handed
        def batch_size(self, n_tokens, new_tokens):
            return 2

        def __call__(self, units):
            units = list(units)
            sizes.extend(len(u.idx) for u in units)
            return ex(units)

    rows = sweep.run_sweep(ex.model_view(), spec_for(lm, batch_size=None), executor=Recording())
    assert sizes == [2, 1, 2, 1] and len(rows) == 6  # 3 samples x 2 settings, in batches of the executor's 2


def test_refusals(client, monkeypatch):
    with pytest.raises(ClusterError, match="no Dask scheduler answers at 'tcp://127.0.0.1:9'"):
        cluster.connect("tcp://127.0.0.1:9", timeout=2)
    with pytest.raises(ClusterError, match="2 of 2 workers could not load 'demo' on 'cuda'"):
        cluster.executor(client, "demo", device="cuda", dtype="float32")
    with pytest.raises(ClusterError, match="could not load 'no/such-model'"):
        cluster.executor(client, "no/such-model", device="cpu")
    monkeypatch.setattr(cluster, "code_hash", lambda: "0" * 16)
    with pytest.raises(ClusterError, match="2 of 2 workers run other gdnviz code than this process"):
        cluster.executor(client, "demo", device="cpu", dtype="float32")


def test_a_worker_killed_mid_sweep_loses_nothing(client, lm, tmp_path):
    """After the first batch comes back, one worker process dies (SIGKILL): its batches run elsewhere (or on the
    worker its nanny restarts, which loads the model again); the rows are those of one process, each stored once."""
    spec = spec_for(lm, seed0=10)
    pids = client.run(os.getpid)
    killed = []

    def kill_one(addr, per_worker):
        if not killed:
            victim = [w for w in pids if w != addr][0]
            killed.append(victim)
            os.kill(pids[victim], signal.SIGKILL)

    ex = cluster.executor(client, "demo", device="cpu", dtype="float32", on_result=kill_one)
    writes = []

    class Store(dict):
        def __setitem__(self, k, v):
            writes.append(k)
            super().__setitem__(k, v)

    rows = sweep.run_sweep(ex.model_view(), spec, store=Store(), executor=ex)
    assert killed
    assert rows.to_dict("records") == sweep.run_sweep(lm, spec).to_dict("records")
    from gdnviz.probes import rates

    answers = [k for k in writes if not rates.is_record(k)]  # and one throughput record per (task, length)
    assert len(answers) == len(set(answers)) == len(rows)
    assert len(writes) - len(answers) == len(set(zip(rows["task"], rows["length"])))


def test_cli_sweep_on_the_cluster(client, tmp_path, capsys):
    from gdnviz.cli import main

    args = ["sweep", "demo", "--tasks", "niah_single_1", "--lengths", "1024", "--ranks", "1", "--n", "1",
            "--device", "cpu", "--dtype", "float32", "--out", str(tmp_path / "out")]
    assert main(args + ["--cluster", client.scheduler.address]) == 0
    err = capsys.readouterr().err
    assert "sweep on the Dask cluster tcp://" in err and "samples answered per worker: tcp://" in err
    rows = (tmp_path / "out" / "rows.csv").read_text().splitlines()
    assert len(rows) == 1 + 2  # header, r = 1 and the untouched r = 16
    assert main(args + ["--cluster", "tcp://127.0.0.1:9"]) != 0
    assert "no Dask scheduler answers at 'tcp://127.0.0.1:9'" in capsys.readouterr().err


def test_the_app_workers_sweep_job_runs_on_the_configured_cluster(client, lm, tmp_path, monkeypatch):
    """GDNVIZ_CLUSTER set: the sweep job answers on the cluster's workers (per-worker progress), rows as in one
    process, the store's memo written here."""
    from gdnviz import jobs
    from gdnviz.store import Store

    monkeypatch.setenv("GDNVIZ_CLUSTER", client.scheduler.address)
    spec = jobs.SweepJob(model="demo", device="cpu", dtype="float32", tasks=("niah_single_1",), lengths=(1024,),
                         ranks=(1,), n=2, batch_size=1, segment_len=256)
    texts = []
    res = jobs.run(spec, jobs.JobContext(Store(tmp_path / "cache"), progress=lambda d, n, t: texts.append(t)))
    assert res["cluster"] == client.scheduler.address and sum(res["per_worker"].values()) == 4
    assert res["computed"] == 4 and any("· workers: " in t for t in texts), texts
    local = sweep.run_sweep(lm, jobs.sweep_spec_of(dataclasses.replace(spec, fingerprint=lm.info.fingerprint)))
    assert [(r["seed"], r["r"], r["pred"]) for r in res["rows"]] == \
        [(int(r.seed), int(r.r), r.pred) for r in local.itertuples()]


# --- scan, budget, loss -------------------------------------------------------------------------------------------
def scan_spec(lm, **kw):
    from gdnviz.probes import scan

    d = dict(model="demo", fingerprint=lm.info.fingerprint, task="niah_single_1", length=512, r=1, by="layer",
             layers=(4, 5), n=2, batch_size=2, max_new_tokens=10, segment_len=256)
    d.update(kw)
    return scan.ScanSpec(**d)


def loss_docs(lm):
    from gdnviz.documents import sample_documents, tokenize

    texts = [d.text for d in sample_documents()][:2]
    return [(f"doc{i}", tokenize(lm.tokenizer, t)[:n]) for i, (t, n) in enumerate(zip(texts, (150, 130)))]


def test_scan_and_loss_sweep_on_the_cluster_equal_one_process_and_resume(client, lm, one_thread, tmp_path):
    """The rows of a scan and of a loss sweep answered on the cluster are those of one process, row for row (each
    unit answered once on a worker); a rerun with the same memo reads everything from it. torch on one thread here,
    as in the workers, so the losses are bit for bit the same."""
    from gdnviz.probes import loss_sweep, scan

    ex = cluster.executor(client, "demo", device="cpu", dtype="float32")
    view = ex.model_view()
    spec = scan_spec(lm)
    res = scan.run_scan(view, spec, store=tmp_path / "memo", executor=ex)
    local = scan.run_scan(lm, spec)
    assert len(res.rows) == 3 * 2 and res.computed == 6  # untouched, L4 cut, L5 cut x 2 samples
    assert res.rows.to_dict("records") == local.rows.to_dict("records")
    assert res.table.to_dict("records") == local.table.to_dict("records") and res.untouched == local.untouched
    assert sum(ex.per_worker.values()) == 6
    again = cluster.executor(client, "demo", device="cpu", dtype="float32")
    res2 = scan.run_scan(view, spec, store=tmp_path / "memo", executor=again)
    assert res2.computed == 0 and not again.per_worker
    assert res2.rows.to_dict("records") == res.rows.to_dict("records")

    docs = loss_docs(lm)
    lspec = loss_sweep.LossSweepSpec(model="demo", ranks=(1,), segment_len=64, min_distance=24,
                                     fingerprint=lm.info.fingerprint)
    ex = cluster.executor(client, "demo", device="cpu", dtype="float32")
    rows = loss_sweep.run_loss_sweep(view, docs, lspec, store=tmp_path / "memo", executor=ex)
    ref = loss_sweep.run_loss_sweep(lm, docs, lspec)
    assert len(rows) == 2 * 2 and sum(ex.per_worker.values()) == 4  # 2 documents x (r = 1, untouched)
    assert rows.to_dict("records") == ref.to_dict("records")
    again = cluster.executor(client, "demo", device="cpu", dtype="float32")
    prog = []
    rows2 = loss_sweep.run_loss_sweep(view, docs, lspec, store=tmp_path / "memo", executor=again,
                                      progress=lambda d, n: prog.append((d, n)))
    assert not again.per_worker and prog == [(4, 4)]
    assert rows2.to_dict("records") == rows.to_dict("records")


def test_budget_search_on_the_cluster_finds_the_one_process_budget(client, lm, tmp_path):
    """A tiny budget search (one rung, no held-out check) whose every sweep runs on the cluster: the same ranks,
    tests and evaluations as in one process."""
    from gdnviz.probes import budget

    spec = budget.BudgetSpec(model="demo", tasks=("niah_single_1",), lengths=(512,), n=2, tolerance=60.0,
                             ladder=(1,), n_heldout=0, max_new_tokens=10, batch_size=4,
                             fingerprint=lm.info.fingerprint)
    ex = cluster.executor(client, "demo", device="cpu", dtype="float32")
    res = budget.find_budget(ex.model_view(), spec, store=tmp_path / "memo", executor=ex)
    local = budget.find_budget(lm, spec)
    assert res.ranks == local.ranks and res.search == local.search and res.evaluations == local.evaluations
    assert sum(ex.per_worker.values()) == res.computed > 0


def test_cli_scan_and_loss_on_the_cluster(client, tmp_path, capsys):
    from gdnviz.cli import main
    from gdnviz.documents import sample_documents

    common = ["demo", "--device", "cpu", "--dtype", "float32", "--cluster", client.scheduler.address]
    scan_args = ["scan", *common, "--task", "niah_single_1", "--length", "512", "--layers", "5", "--n", "1",
                 "--max-new-tokens", "10", "--out", str(tmp_path / "scan")]
    assert main(scan_args) == 0
    err = capsys.readouterr().err
    assert "scan on the Dask cluster tcp://" in err and "samples answered per worker: tcp://" in err
    assert len((tmp_path / "scan" / "scan.csv").read_text().splitlines()) == 1 + 1  # header, layer 5
    doc = tmp_path / "doc.txt"
    doc.write_text(sample_documents()[0].text[:1500])
    loss_args = ["loss", *common, str(doc), "--ranks", "1", "--segment-len", "64", "--min-distance", "24",
                 "--out", str(tmp_path / "loss")]
    assert main(loss_args) == 0
    err = capsys.readouterr().err
    assert "loss on the Dask cluster tcp://" in err and "(document, setting) runs answered per worker: tcp://" in err
    assert len((tmp_path / "loss" / "loss_documents.csv").read_text().splitlines()) == 1 + 2  # r = 1, untouched
    assert main(loss_args) == 0  # again: all from the memo
    assert "none (all from the memo)" in capsys.readouterr().err
    assert main(["scan", "demo", "--task", "vt", "--length", "512", "--cluster", "local", "--device-map", "auto",
                 "--out", str(tmp_path / "x")]) == 2
    assert "--device-map and --cluster exclude each other" in capsys.readouterr().err


def test_the_app_workers_scan_budget_and_loss_jobs_run_on_the_configured_cluster(client, lm, tmp_path, monkeypatch):
    """GDNVIZ_CLUSTER set: the scan, budget and loss jobs answer on the cluster's workers, with the answers per worker
    in their progress and their results, the store's memo written here."""
    from gdnviz import jobs
    from gdnviz.documents import sample_documents
    from gdnviz.errors import BadDeviceMap
    from gdnviz.store import Store

    monkeypatch.setenv("GDNVIZ_CLUSTER", client.scheduler.address)
    store = Store(tmp_path / "cache")
    model = dict(model="demo", device="cpu", dtype="float32")
    specs = [jobs.ScanJob(task="niah_single_1", length=512, layers=(5,), n=1, max_new_tokens=10, **model),
             jobs.BudgetJob(tasks=("niah_single_1",), lengths=(512,), n=2, tolerances=(60.0,), ladder=(1,),
                            n_heldout=0, max_new_tokens=10, batch_size=4, **model),
             jobs.LossJob(documents=(("doc", sample_documents()[0].text[:1500]),), ranks=(1,), segment_len=64,
                          min_distance=24, **model)]
    for spec in specs:
        texts = []
        res = jobs.run(spec, jobs.JobContext(store, progress=lambda d, n, t: texts.append(t)))
        answers = res["budgets"][0]["computed"] if spec.kind == "budget" else res["computed"]  # not its result entry
        assert res["cluster"] == client.scheduler.address and sum(res["per_worker"].values()) == answers > 0
        assert any("· workers: " in t for t in texts), (spec.kind, texts)
    with pytest.raises(BadDeviceMap, match="a scan with a device_map runs in this process"):
        jobs.run(dataclasses.replace(specs[0], device_map="auto"), jobs.JobContext(store))


def _visible():
    return os.environ.get("CUDA_VISIBLE_DEVICES")


def test_gpu_worker_specs_give_each_worker_process_its_own_gpu(monkeypatch):
    """The local GPU cluster's workers (``gpu_worker_specs``, started as nannies as ``connect("local")`` does on a
    GPU machine): each worker process sees exactly its own entry of CUDA_VISIBLE_DEVICES. Run with CPU workers
    here (the variable is what a GPU worker's torch reads at its first CUDA call)."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,GPU-abc,5")
    assert cluster.visible_gpus(2) == ["3", "GPU-abc"]
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert cluster.visible_gpus(3) == ["0", "1", "2"]
    specs = cluster.gpu_worker_specs(["3", "GPU-abc"])
    spec = distributed.SpecCluster(
        scheduler={"cls": distributed.Scheduler, "options": {"dashboard_address": None}},
        workers={name: {"cls": distributed.Nanny, "options": opts} for name, opts in specs.items()})
    with spec, distributed.Client(spec) as c:
        c.wait_for_workers(2, timeout=60)
        seen = c.run(_visible)
        names = {w["name"] for w in c.scheduler_info()["workers"].values()}
    assert sorted(seen.values()) == ["3", "GPU-abc"] and set(names) == {"gpu-3", "gpu-GPU-abc"}
