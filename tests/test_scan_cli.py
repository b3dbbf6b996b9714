"""``gdnviz scan`` and ``gdnviz budget`` on the tiny checkpoint (d_k = d_v = 16, GDN layers 0, 1, 3): the files
they write, their exact columns, a resumed run, and bad input as one-line messages."""
import json
import os
import subprocess
import sys

import pandas as pd
import pytest

import checkpoints

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return checkpoints.tiny_qwen35_checkpoint(tmp_path_factory.mktemp("scan_ckpt"))


def common(out):
    return ["--n", "2", "--batch", "2", "--max-new-tokens", "6", "--out", str(out), "--device", "cpu",
            "--dtype", "float32"]


def test_cli_scan_writes_scan_csv(ckpt, tmp_path, capsys):
    from gdnviz.cli import main

    out = tmp_path / "scan"
    cmd = ["scan", str(ckpt), "--task", "niah_single_1", "--length", "400", "--by", "layer", "--r", "2"]
    assert main(cmd + common(out)) == 0
    err = capsys.readouterr().err
    assert ("3 units, 4 settings x 2 samples = 8 answers, 0 in the memo, 8 to run; no estimate yet (no earlier run of "
            "niah_single_1 at 400 tokens") in err
    text = (out / "scan.csv").read_text().splitlines()
    assert text[0] == "layer,head,r,n,score,baseline,delta,se"
    assert [line.split(",")[:4] for line in text[1:]] == [["0", "", "2", "2"], ["1", "", "2", "2"],
                                                          ["3", "", "2", "2"]]
    assert (out / "heatmap.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    settings = json.loads((out / "settings.json").read_text())
    assert settings["spec"]["by"] == "layer" and settings["computed"] == 8
    # again: everything from the memo, and the plan says so with a measured rate
    assert main(cmd + common(out)) == 0
    err = capsys.readouterr().err
    assert "8 in the memo, 0 to run; nothing to generate" in err
    # a head scan narrowed to one layer, keep-one
    out2 = tmp_path / "keep"
    assert main(["scan", str(ckpt), "--task", "niah_single_1", "--length", "400", "--by", "head", "--r", "2",
                 "--keep", "--layers", "3", "--memo", str(out / "cache")] + common(out2)) == 0
    df = pd.read_csv(out2 / "scan.csv")
    assert df[["layer", "head"]].values.tolist() == [[3, h] for h in range(4)]
    # bad input: one line each, exit code 2
    for extra, message in ((["--r", "16"], "RankOutOfRange: r = 16 keeps every state untouched"),
                           (["--layers", "2"], "GDNVizError: layer 2 is not a Gated DeltaNet layer"),
                           (["--max-prompts", "3"], "TooManyPrompts: this scan would generate 8 answers")):
        assert main(["scan", str(ckpt), "--task", "niah_single_1", "--length", "400", "--r", "2"] + common(
            tmp_path / "bad") + extra) == 2
        assert message in capsys.readouterr().err
    assert main(["scan", str(ckpt), "--task", "nope", "--length", "400"] + common(tmp_path / "bad")) == 2
    assert "UnknownTask: Unknown RULER task 'nope'" in capsys.readouterr().err


def test_cli_budget_writes_budget_csv_and_summary(ckpt, tmp_path):
    out = tmp_path / "budget"
    cmd = [sys.executable, "-m", "gdnviz", "budget", str(ckpt), "--tasks", "niah_single_1", "--lengths", "400",
           "--tolerance", "5", "--ladder", "4,1", "--curve", "10"] + common(out)
    res = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True, text=True,
                         timeout=400)
    assert res.returncode == 0, res.stderr[-3000:]
    t = pd.read_csv(out / "budget.csv")
    assert list(t.columns) == ["layer", "head", "r"] and len(t) == 12 and t["r"].between(1, 16).all()
    s = json.loads((out / "summary.json").read_text())
    assert s["state_bytes_full"] == 3 * 4 * 16 * 16 * 4
    assert s["state_bytes_budget"] == sum(min(r * 32, 256) if r < 16 else 256 for r in t["r"]) * 4
    assert set(s["tasks"]) == {"niah_single_1@400"} and set(s["heldout"]) == {"niah_single_1@400"}
    for k in ("untouched", "score", "delta", "se", "bound", "passed", "n"):
        assert k in s["tasks"]["niah_single_1@400"] and k in s["heldout"]["niah_single_1@400"]
    assert s["heldout_seeds"] == [2, 3] and s["search_seeds"] == [0, 1]
    ranks = json.loads((out / "rank_map.json").read_text())["ranks"]
    assert sorted(ranks) == sorted([l, h, r] for l, h, r in t.values.tolist() if r < 16)
    curve = pd.read_csv(out / "curve.csv")
    assert set(curve["tolerance"]) == {0.0, 5.0, 10.0}
    assert (out / "curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    bad = subprocess.run(cmd[:9] + ["--tolerance", "0"] + common(tmp_path / "bad"), cwd=ROOT,
                         env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True, text=True, timeout=200)
    assert bad.returncode == 2 and "tolerance must be a number of points > 0, got 0.0" in bad.stderr
