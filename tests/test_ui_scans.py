"""The Head scans & budgets page's pure logic: tolerances, the layers worth a head scan, the Sweeps hand-off line
(read back by the Sweeps page's parser), file names as rank-map names."""
import pandas as pd
import pytest

from gdnviz.ui import scans as S
from gdnviz.ui.sweeps import parse_rank_maps

INFO = dict(gdn_layers=[0, 1, 2, 4, 5, 6], num_heads=2, d_k=128, d_v=128)


def test_parse_tolerances():
    assert S.parse_tolerances("1, 2.5; 5, 1") == [1.0, 2.5, 5.0]
    assert S.parse_tolerances("") == []
    for text, msg in (("1, x", "'x' is not one"), ("0", "0 is not"), ("-2", "-2 is not")):
        with pytest.raises(ValueError, match=msg):
            S.parse_tolerances(text)


def test_layers_that_matter_needs_five_points_and_two_ses():
    t = pd.DataFrame(dict(layer=[0, 1, 2, 5], head=pd.array([None] * 4, dtype="Int64"), r=1, n=10,
                          score=0.0, baseline=0.0, delta=[-4.0, -6.0, -8.0, -90.0], se=[1.0, 2.0, 5.0, 10.0]))
    assert S.layers_that_matter(t) == [1, 5]  # 0: under 5 points; 2: under two SEs


def test_budget_hand_off_line_is_read_by_the_sweeps_page():
    summ = dict(rank_map=[[0, 0, 1], [5, 1, 32]], tolerance=1.0)
    line = S.sweeps_line(S.budget_name(summ), summ)
    assert line == "budget_d1: 0:0:1, 5:1:32"
    assert parse_rank_maps(line, INFO) == (("budget_d1", ((0, 0, 1), (5, 1, 32))),)
    assert S.budget_name(dict(tolerance=2.5)) == "budget_d2_5"
    assert S.sweeps_line("x", dict(rank_map=[])) == ""
    assert S.map_name("my budget (v2).json") == "my_budget_v2" and S.map_name("???.json") == "imported"
    assert parse_rank_maps(f"{S.map_name('a b.json')}: 0:0:4", INFO)[0][0] == "a_b"


def test_a_rank_map_becomes_truncate_groups_and_back():
    """groups_from_rank_map: one "heads" group per rank, increasing; resolve() gives the same per-head ranks."""
    from gdnviz.ui.truncation import groups_from_rank_map, resolve

    info = dict(gdn_layers=[0, 1, 2, 4, 5, 6], num_heads=2, d_k=128, d_v=128)
    ranks = {(5, 1): 32, (0, 0): 1, (2, 1): 1, (6, 0): 4}
    groups = groups_from_rank_map(ranks)
    assert [g["r"] for g in groups] == [1, 4, 32] and all(g["mode"] == "heads" for g in groups)
    assert groups[0]["heads"] == [[0, 0], [2, 1]]
    got, counts = resolve(groups, info)
    assert got == ranks and counts == [2, 1, 1]
    assert groups_from_rank_map({}) == []


def test_rank_map_json_round_trip_and_its_refusals():
    """rank_map_text saves the heads below full rank in budget.rank_map_json's format; rank_map_from_text reads it
    back against the model, and names what is wrong with a bad map (the one rank validator's messages for ranks)."""
    import json

    from gdnviz.errors import GDNVizError, RankOutOfRange
    from gdnviz.ui.truncation import rank_map_from_text, rank_map_text

    info = dict(INFO, name="demo", fingerprint="f" * 40)
    ranks = {(5, 1): 32, (0, 0): 1, (2, 1): 128, (6, 0): 4}
    text = rank_map_text(ranks, info)
    d = json.loads(text)
    assert d["format"] == "gdnviz-rank-map-v1" and d["ranks"] == [[0, 0, 1], [5, 1, 32], [6, 0, 4]]
    assert rank_map_from_text(text, info) == ({(0, 0): 1, (5, 1): 32, (6, 0): 4}, "")
    _, note = rank_map_from_text(text, dict(info, fingerprint="0" * 40))
    assert note.startswith("This rank map was made for another model (demo, fingerprint ffffffffffff)")
    for bad, err, msg in (("{not json", GDNVizError, "the rank map is not JSON"),
                          ('{"ranks": "0:0:4"}', GDNVizError, 'needs a list "ranks"'),
                          ("[[0, 0, 4], [1, 1]]", GDNVizError, r"entry 1 of the rank map's \"ranks\" is \[1, 1\], not"),
                          ('{"ranks": []}', GDNVizError, "lists no heads"),
                          ("[[3, 0, 4]]", ValueError, r"layer 3 is not a Gated DeltaNet layer \(GDN layers: \[0, 1"),
                          ("[[0, 2, 4]]", ValueError, r"head 2 out of range: GDN layers have 2 heads \(0..1\)"),
                          ("[[0, 0, 0]]", RankOutOfRange, "rank 0 for layer 0 head 0 is outside 1..min"),
                          ("[[0, 1, 129]]", RankOutOfRange, r"rank 129 for layer 0 head 1 is outside 1..128"),
                          ("[[0, 1, 2.5]]", RankOutOfRange, "must be an integer ≥ 1; got 2.5")):
        with pytest.raises(err, match=msg):
            rank_map_from_text(bad, info)
