"""The Sweeps page's pure logic (gdnviz.ui.sweeps): per-head rank maps, their table, the previous-sweeps list."""
from __future__ import annotations

import time

import pandas as pd
import pytest

from gdnviz.errors import RankOutOfRange
from gdnviz.store import Store
from gdnviz.ui import sweeps as S

INFO = dict(gdn_layers=[0, 1, 2, 4], num_heads=2, d_k=16, d_v=16)


def test_rank_maps_parse_lines_names_and_heads():
    text = "# comment\n\nearly: 0:0:1, 0:1:1\nmixed = 4:1:16; 2:0:3 1:1:2\n"
    assert S.parse_rank_maps(text, INFO) == (
        ("early", ((0, 0, 1), (0, 1, 1))),
        ("mixed", ((1, 1, 2), (2, 0, 3), (4, 1, 16))),  # sorted by head
    )
    assert S.parse_rank_maps("", INFO) == () and S.parse_rank_maps("  \n# only a comment", INFO) == ()


@pytest.mark.parametrize("text, exc, message", [
    ("just words", ValueError, "line 1: expected NAME: layer:head:r"),
    ("m:", ValueError, "line 1: expected NAME"),
    ("m: 0:0", ValueError, "'0:0' is not layer:head:r"),
    ("m: 3:0:1", ValueError, "layer 3 is not a GDN layer (GDN layers: 0, 1, 2, 4)"),
    ("m: 0:2:1", ValueError, "head 2 does not exist (heads 0..1)"),
    ("m: 0:0:0", RankOutOfRange, "rank 0 for layer 0 head 0 (rank maps, line 1, m) is outside 1..16"),
    ("m: 0:0:17", RankOutOfRange, "rank 17 for layer 0 head 0 (rank maps, line 1, m) is outside 1..16"),
    ("m: 0:0:1, 0:0:2", ValueError, "head 0:0 appears twice"),
    ("m: 0:0:1\nm: 0:1:1", ValueError, "line 2: the name 'm' is used twice"),
    ("uniform: 0:0:1", ValueError, "'uniform' is the name of the uniform-rank rows"),
    ("bad name!: 0:0:1", ValueError, "must be 1–40 letters"),
])
def test_rank_maps_bad_lines_are_named(text, exc, message):
    with pytest.raises(exc) as e:
        S.parse_rank_maps(text, INFO)
    assert message in str(e.value)


def test_rank_map_line_round_trips():
    line = S.rank_map_line("truncate_page", {"4:1": 3, "0:0": 1, (1, 1): 16})
    assert line == "truncate_page: 0:0:1, 1:1:16, 4:1:3"
    assert S.parse_rank_maps(line, INFO) == (("truncate_page", ((0, 0, 1), (1, 1, 16), (4, 1, 3))),)


def test_rank_map_table_pairs_each_map_with_the_untouched_score():
    tab = pd.DataFrame([
        dict(task="vt", length=512, setting="uniform", r=1, score=50.0, n=4, untouched=75.0, delta=-25.0, se=14.4),
        dict(task="vt", length=512, setting="uniform", r=16, score=75.0, n=4, untouched=75.0, delta=0.0, se=0.0),
        dict(task="vt", length=512, setting="early", r=None, score=25.0, n=4, untouched=75.0, delta=-50.0, se=28.9),
        dict(task="vt", length=512, setting="late", r=None, score=75.0, n=4, untouched=75.0, delta=0.0, se=0.0),
    ])
    out = S.rank_map_table(tab)
    assert list(out.columns) == ["task", "length (tokens)", "untouched", "early", "late", "n"]
    assert out.iloc[0].tolist() == ["vt", 512, "75.0", "25.0 (−50.0 ± 28.9)", "75.0 (+0.0 ± 0.0)", 4]
    assert S.rank_map_table(tab[tab["setting"] == "uniform"]) is None


def test_previous_sweeps_lists_finished_sweeps_newest_first(tmp_path):
    st = Store(tmp_path / "cache")
    spec = dict(model="/m/demo", tasks=["vt"], lengths=[1024], ranks=[1, 4], n=5, rank_maps={"early": [[0, 0, 1]]})
    a = st.submit("sweep", spec)
    st.update_job(a, status="done", finished=time.time() - 60, result=dict(model_name="/m/demo", rmax=128))
    b = st.submit("sweep", dict(spec, rank_maps={}, tasks=["niah_single_1", "vt"]))
    st.update_job(b, status="done", finished=time.time(), result=dict(model_name="/m/demo", rmax=128))
    c = st.submit("sweep", spec)  # still queued: not listed
    d = st.submit("capture", {})
    st.update_job(d, status="done", finished=time.time(), result={})  # not a sweep
    e = st.submit("sweep", spec)
    st.update_job(e, status="failed", finished=time.time(), error="boom")  # failed: not listed
    got = S.previous_sweeps(st)
    assert [g["id"] for g in got] == [b, a] and c not in [g["id"] for g in got]
    assert "demo · niah_single_1, vt · 1,024 tokens · r = 1, 4, 128 (untouched) · n = 5" in got[0]["label"]
    assert got[1]["label"].endswith("n = 5 · 1 rank map(s)")


def test_readout_note_names_how_the_truncated_run_ran():
    from gdnviz.ui.truncation import readout_note

    assert readout_note(None) == "" and readout_note([]) == ""
    assert readout_note(["segment-loop"]) == " · truncated run: segment loop"
    assert readout_note(["decode-graph", "one-call", "segment-graph"]) == (
        " · truncated run: decode steps replayed from a CUDA graph, one kernel call where no boundary falls, "
        "CUDA-graph windows")


def test_prompt_length_note_gives_the_real_prompt_sizes_per_target_length():
    """Lengths are targets: the note gives each target's real prompt token counts over its distinct samples (one
    sample answered at several r counts once)."""
    rows = pd.DataFrame([dict(task=t, length=L, seed=s, r=r, n_tokens=n) for t, L, s, n in (
        ("vt", 1024, 0, 873), ("vt", 1024, 1, 901), ("niah_single_1", 1024, 0, 880), ("vt", 4096, 0, 3950))
        for r in (1, 16)])
    note = S.prompt_length_note(rows)
    assert note.startswith("Lengths are targets")
    assert "at length 1,024 the prompts have 873–901 tokens (3 prompts)" in note
    assert "at 4,096: 3,950 tokens (1 prompt)" in note
    assert S.prompt_length_note(rows.drop(columns="n_tokens")) is None
