"""Sweeps end to end on the tiny checkpoint: rows, memo and resume, the paired-SE table, bad inputs, the CLI."""
import json
import math
import os
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest

import checkpoints
from gdnviz.errors import EmptyDocumentSet, RankOutOfRange, TaskTooShort, UnknownTask
from gdnviz.generate import Generation
from gdnviz.probes import sweep

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TASKS = ("niah_single_1", "vt")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return checkpoints.tiny_qwen35_checkpoint(tmp_path_factory.mktemp("sweep_ckpt"))


@pytest.fixture(scope="module")
def lm(ckpt):
    from gdnviz.models import load

    return load(str(ckpt), device="cpu", dtype="float32")


@pytest.fixture
def counted(monkeypatch):
    """Count the model calls (batched_greedy) and the samples they answer."""
    calls = []
    real = sweep.batched_greedy

    def wrapper(lm, prompts, *a, **kw):
        calls.append(len(prompts))
        return real(lm, prompts, *a, **kw)

    monkeypatch.setattr(sweep, "batched_greedy", wrapper)
    return calls


def small_spec(lm, **kw):
    d = dict(model="tiny", fingerprint=lm.info.fingerprint, tasks=TASKS, lengths=(1024,), ranks=(4,), n=2,
             batch_size=2, segment_len=256, max_new_tokens=12)
    d.update(kw)
    return sweep.SweepSpec(**d)


def test_sweep_end_to_end_and_resume(lm, tmp_path, counted):
    spec = small_spec(lm)
    seen = []
    rows = sweep.run_sweep(lm, spec, store=tmp_path / "cache", progress=lambda d, n: seen.append((d, n)))
    # 2 tasks x 1 length x 2 ranks (4 and the untouched 16) x 2 samples, two samples per forward
    assert len(rows) == 8 and counted == [2] * 4
    assert list(rows.columns) == sweep.ROW_COLUMNS
    assert sorted(rows["r"].unique().tolist()) == [4, 16] and set(rows["task"]) == set(TASKS)
    assert set(rows["seed"]) == {0, 1} and (rows["n_generated"] <= 12).all()
    assert rows["score"].between(0, 100).all() and rows["answers"].map(len).min() >= 1
    assert seen[-1] == (8, 8)
    # the same sweep again: nothing recomputed, identical rows
    counted.clear()
    again = sweep.run_sweep(lm, spec, store=tmp_path / "cache")
    assert counted == []
    pd.testing.assert_frame_equal(rows, again)
    # one more sample per cell and one more rank: only the new cells run
    more = sweep.run_sweep(lm, small_spec(lm, n=3, ranks=(4, 8)), store=str(tmp_path / "cache"))
    assert len(more) == 2 * 3 * 3
    assert sum(counted) == 2 * (1 + 1) + 2 * 3  # seed 2 at r = 4 and 16, and r = 8 for all three seeds
    old = more[more.seed < 2].merge(rows, on=["task", "length", "setting", "r", "seed"])
    assert len(old) == 8 and (old["pred_x"] == old["pred_y"]).all()
    table = sweep.sweep_table(more)
    assert len(table) == 2 * 3 and (table[table.r == 16]["delta"] == 0).all()


def test_scores_flow_into_the_table(lm, monkeypatch):
    """A stand-in model that answers right only when untouched: score 100 vs 0, delta -100, SE 0."""
    def fake(lm_, prompts, max_new_tokens, *, segment_len, spec=None, **kw):
        return [Generation(prompt_len=len(p), tokens=[1], text=" " + ANSWERS[tuple(p)] if spec is None else " no")
                for p in prompts]

    from gdnviz.probes import ruler

    ANSWERS = {tuple(s.input_ids): ", ".join(s.answers)
               for t in TASKS for s in ruler.generate_many(t, lm.tokenizer, 1024, 2, 0)}
    monkeypatch.setattr(sweep, "batched_greedy", fake)
    rows = sweep.run_sweep(lm, small_spec(lm))
    t = sweep.sweep_table(rows)
    assert (t[t.r == 16]["score"] == 100).all() and (t[t.r == 4]["score"] == 0).all()
    assert (t[t.r == 4]["delta"] == -100).all() and (t[t.r == 4]["se"] == 0).all()


def test_paired_se_by_hand():
    # one task, one length, 4 samples; untouched r = 8
    base = [100, 100, 0, 50]
    r1 = [0, 100, 0, 0]
    r4 = [100, 50, 50, 50]
    rows = pd.DataFrame(
        [dict(task="vt", length=1024, setting="uniform", r=r, seed=s, score=float(v))
         for r, vals in ((8, base), (1, r1), (4, r4)) for s, v in enumerate(vals)]
        + [dict(task="vt", length=1024, setting="mymap", r=pd.NA, seed=s, score=float(v))
           for s, v in enumerate([100, 100, 0, 0])])
    t = sweep.sweep_table(rows)
    assert t["r"].tolist()[:3] == [1, 4, 8] and t["setting"].tolist()[-1] == "mymap"
    row = t[t.r == 1].iloc[0]
    d = np.array([-100, 0, 0, -50], float)  # r1 - base
    assert row["n"] == 4 and row["score"] == 25 and row["untouched"] == 62.5
    assert row["delta"] == pytest.approx(-37.5)
    # sample std of d: mean -37.5, squares 3906.25 + 1406.25 * 2 + 156.25 = 6875, / 3 -> sqrt / 2
    assert row["se"] == pytest.approx(math.sqrt(6875 / 3) / 2)
    assert row["se"] == pytest.approx(d.std(ddof=1) / 2)
    row4 = t[t.r == 4].iloc[0]
    assert row4["delta"] == pytest.approx(0.0) and row4["se"] == pytest.approx(np.std([0, -50, 50, 0], ddof=1) / 2)
    assert t[t.r == 8].iloc[0][["delta", "se"]].tolist() == [0, 0]
    m = t[t.setting == "mymap"].iloc[0]
    assert m["delta"] == pytest.approx(-12.5) and m["se"] == pytest.approx(np.std([0, 0, 0, -50], ddof=1) / 2)
    one = sweep.sweep_table(rows[rows.seed == 0])
    assert one["se"].isna().all() or (one[one.r == 8]["se"].isna()).all()  # n = 1: no standard error
    chart = sweep.sweep_figure(t)
    spec = chart.to_dict()
    assert spec["facet"]["column"]["field"] == "length"
    assert spec["facet"]["column"]["header"]["labelExpr"] == "format(datum.value, ',')"  # 16,384, not 16384


def test_default_ranks_clip_to_dk():
    assert sweep.resolve_ranks(None, 16) == [1, 4, 12, 16]
    assert sweep.resolve_ranks(None, 128) == [1, 4, 12, 32, 128]
    assert sweep.resolve_ranks([4, 1], 16) == [1, 4, 16]


def test_bad_inputs(lm, counted):
    with pytest.raises(UnknownTask, match="niah_single_1"):
        sweep.run_sweep(lm, small_spec(lm, tasks=("niah_single_1", "needle_in_a_haystack")))
    with pytest.raises(TaskTooShort, match="vt needs a target length of at least"):
        sweep.run_sweep(lm, small_spec(lm, lengths=(1024, 512)))
    for bad in ((0,), (4, 17), (2.5,)):
        with pytest.raises(RankOutOfRange):
            sweep.run_sweep(lm, small_spec(lm, ranks=bad))
    with pytest.raises(EmptyDocumentSet):
        sweep.run_sweep(lm, small_spec(lm, n=0))
    with pytest.raises(EmptyDocumentSet):
        sweep.run_sweep(lm, small_spec(lm, tasks=()))
    with pytest.raises(ValueError, match="head 9"):
        sweep.run_sweep(lm, small_spec(lm, heads="0:9"))
    with pytest.raises(ValueError, match="fingerprint"):
        sweep.run_sweep(lm, small_spec(lm, fingerprint="0" * 16))
    assert counted == [], "bad input must be refused before any model call"
    assert sweep.resolve_heads("layers:0", lm.info) == [(0, h) for h in range(lm.info.num_heads)]
    assert sweep.resolve_heads("3:1,0:2", lm.info) == [(0, 2), (3, 1)]


def test_cli_sweep_writes_its_files(ckpt, tmp_path, capsys):
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "gdnviz", "sweep", str(ckpt), "--tasks", ",".join(TASKS), "--lengths", "1024",
           "--ranks", "4", "--n", "2", "--batch", "2", "--max-new-tokens", "6", "--heads", "layers:0,1",
           "--out", str(out), "--device", "cpu", "--dtype", "float32"]
    env = dict(os.environ, PYTHONPATH=ROOT)
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stderr[-3000:]
    assert {p.name for p in out.iterdir()} >= {"rows.csv", "table.csv", "figure.png", "settings.json", "cache"}
    table = pd.read_csv(out / "table.csv")
    assert list(table.columns) == sweep.TABLE_COLUMNS and len(table) == 4
    assert len(pd.read_csv(out / "rows.csv")) == 8
    assert (out / "figure.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    settings = json.loads((out / "settings.json").read_text())
    assert settings["spec"]["tasks"] == list(TASKS) and settings["spec"]["heads"] == "layers:0,1"
    assert "sweep" in res.stderr  # the progress bar
    from gdnviz.cli import main  # bad input, in process (no second interpreter start-up)

    assert main(cmd[3:6] + ["nope"] + cmd[7:]) == 2
    assert "UnknownTask" in capsys.readouterr().err
    assert main(cmd[3:] + ["--ranks", "4,64"]) == 2
    assert "RankOutOfRange" in capsys.readouterr().err


def test_cli_loss_in_process(ckpt, tmp_path, capsys):
    from gdnviz.cli import main

    doc = tmp_path / "doc.txt"
    doc.write_text("The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. " * 12)
    out = tmp_path / "loss"
    assert main(["loss", str(ckpt), str(doc), "--ranks", "2", "--segment-len", "64", "--min-distance", "64",
                 "--out", str(out), "--device", "cpu", "--dtype", "float32"]) == 0
    df = pd.read_csv(out / "loss.csv")
    assert df["r"].tolist() == [2] * 3 + [16] * 3 and (df.loc[(df.r == 16) & (df.n_docs > 0), "delta"] == 0).all()
    # periodic text: copies more than 64 back (copy_any), but never only that far back (copy_recent is empty)
    assert df.loc[df.subset == "copy_any", "n_predictions"].min() > 0
    assert (df.loc[df.subset == "copy_recent", "n_docs"] == 0).all()
    assert json.loads((out / "settings.json").read_text())["spec"]["ranks"] == [2]
    assert main(["loss", str(ckpt), str(doc), "--ranks", "32", "--out", str(out), "--device", "cpu"]) == 2
    assert "RankOutOfRange" in capsys.readouterr().err


def test_cell_key_is_the_key_cells_were_stored_under():
    """``sweep.cell_key`` is the only builder of a sweep's memo key; it gives the bytes the worker's store used
    before (the cell hash wrapped with the version string), so stored cells stay valid."""
    import hashlib
    from types import SimpleNamespace

    from gdnviz.store import content_hash

    info = SimpleNamespace(fingerprint="fp123", dtype="float32")
    sample = SimpleNamespace(input_ids=[5, 6, 7], seed=3)
    spec = sweep.SweepSpec(model="tiny", tasks=("vt",), lengths=(1024,), segment_len=256, max_new_tokens=12)
    setting = sweep._Setting(sweep.UNIFORM, 4, None)
    prompt = hashlib.sha256(np.asarray([5, 6, 7], dtype=np.int64).tobytes()).hexdigest()[:16]
    d = dict(v=1, fp="fp123", dtype="float32", task="vt", length=1024, trunc=None, seed=3, prompt=prompt, L=256,
             new=12)
    inner = "sweep:" + hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()
    stored = "sweep:" + content_hash(dict(version="sweep-cells-v1", cell=inner))
    assert sweep.VERSION == 1
    assert sweep.cell_key(info, "vt", 1024, setting, sample, spec) == stored


def test_a_cancel_while_the_prompts_are_built_stops_at_once(lm, counted):
    """``preparing(built, total)`` is called after every prompt, before any model call: one that raises (the
    worker's cancel) stops the sweep there, not after all n x tasks x lengths prompts."""
    from gdnviz.errors import JobCancelled

    seen = []

    def preparing(built, total):
        seen.append((built, total))
        if built == 3:
            raise JobCancelled("cancelled by the user")

    with pytest.raises(JobCancelled):
        sweep.run_sweep(lm, small_spec(lm, n=200), preparing=preparing)
    assert seen == [(1, 400), (2, 400), (3, 400)] and counted == []
    seen.clear()
    sweep.run_sweep(lm, small_spec(lm, n=1, ranks=(16,)), preparing=lambda b, t: seen.append((b, t)))
    assert seen == [(1, 2), (2, 2)]


def test_a_batch_that_runs_out_of_memory_is_answered_in_halves(lm, monkeypatch):
    """Device memory exhausted on a batch of 4 (injected: the real batched_greedy, refused above 1 prompt the first
    time and above 2 after that): the batch is answered in halves, down to the size that fits, with the rows a
    batch-1 sweep gives; a single prompt that runs out is an error, not a silent gap."""
    import torch

    real = sweep.batched_greedy
    sizes = []

    def tight(lm, prompts, *a, **kw):
        sizes.append(len(prompts))
        if len(prompts) > 2:
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        return real(lm, prompts, *a, **kw)

    spec = small_spec(lm, tasks=("niah_single_1",), n=4, batch_size=4)
    monkeypatch.setattr(sweep, "batched_greedy", tight)
    rows = sweep.run_sweep(lm, spec)
    assert sizes == [4, 2, 2, 4, 2, 2]  # per setting: the batch of 4, then its halves
    monkeypatch.setattr(sweep, "batched_greedy", real)
    one = sweep.run_sweep(lm, small_spec(lm, tasks=("niah_single_1",), n=4, batch_size=1))
    pd.testing.assert_frame_equal(rows, one)

    def none_fit(lm, prompts, *a, **kw):
        raise torch.OutOfMemoryError("CUDA out of memory (injected)")

    monkeypatch.setattr(sweep, "batched_greedy", none_fit)
    with pytest.raises(torch.OutOfMemoryError):
        sweep.run_sweep(lm, small_spec(lm, tasks=("niah_single_1",), n=2, batch_size=2))


def test_batch_size_left_open_is_chosen(lm, counted):
    """batch_size=None: at most 8 rows per forward on CPU (auto_batch_size), the samples spread evenly over as few
    batches as that allows (10 samples: 5 + 5, not 8 + 2, whose second batch would decode as long as the first);
    the estimate behind the CUDA choice grows with the prompt length (quadratically once the attention mask
    dominates) and counts the model's own shapes."""
    from bench.common import qwen35_08b_config
    from gdnviz.probes.batch_size import CPU_ROWS, auto_batch_size, row_bytes

    assert auto_batch_size(lm, 1024, 12) == CPU_ROWS == 8
    sweep.run_sweep(lm, small_spec(lm, tasks=("niah_single_1",), n=10, batch_size=None))
    assert counted == [5, 5, 5, 5]
    with pytest.raises(ValueError, match="batch size"):
        sweep.run_sweep(lm, small_spec(lm, batch_size=0))
    import torch
    from transformers import Qwen3_5ForCausalLM

    with torch.device("meta"):
        big = Qwen3_5ForCausalLM(qwen35_08b_config(vocab_size=8192)).to(torch.bfloat16)
    b4, b16, b128 = (row_bytes(big, n, 128) for n in (4096, 16384, 131072))
    assert b4 < b16 < b128 and b128 > 2 * 131072**2  # the T × T mask alone
    assert 1e8 < b4 < 2e9 and 1e9 < b16 < 8e9
    assert row_bytes(lm.model, 1024, 12) < b4


def test_a_sweep_whose_prompts_cannot_fit_in_memory_is_refused_before_any_is_built(lm, counted, monkeypatch):
    """n = 10,000 samples of 6 tasks at 20 lengths near the default token limit: about 3.9e10 prompt tokens, far
    more than any machine holds. Refused with TooManyPrompts (the tokens, the bytes, the memory available) before
    the first prompt is built; a sweep that fits the memory available is not."""
    from gdnviz.errors import TooManyPrompts
    from gdnviz.probes import ruler

    def no_prompts(*a, **kw):
        raise AssertionError("a prompt was built before the sweep's size was checked")

    lengths = tuple(32_768 - i for i in range(20))
    big = small_spec(lm, tasks=tuple(ruler.TASK_NAMES), lengths=lengths, n=10_000)
    need = sweep.prompt_bytes(big)
    assert need == 10_000 * len(ruler.TASK_NAMES) * sum(lengths) * sweep.PROMPT_BYTES_PER_TOKEN
    monkeypatch.setattr(ruler, "generate_many", no_prompts)
    with pytest.raises(TooManyPrompts, match=r"n = 10,000 .* 6 task\(s\) .* 20 length\(s\)") as e:
        sweep.run_sweep(lm, big)
    assert "GiB" in str(e.value) and "available" in str(e.value) and "lower n" in str(e.value)
    with pytest.raises(TooManyPrompts):
        sweep.check_prompt_memory(small_spec(lm), available=sweep.prompt_bytes(small_spec(lm)))  # needs half
    sweep.check_prompt_memory(small_spec(lm), available=2 * sweep.prompt_bytes(small_spec(lm)))
    assert counted == []
