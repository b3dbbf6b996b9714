"""Figures that must stay readable on degenerate heads (the demo's rank-1 heads)."""
from types import SimpleNamespace

import numpy as np

from gdnviz import figures as F


def _capture(sv_end: np.ndarray):
    sv = np.zeros((2, 1, 1, sv_end.size), np.float32)
    sv[-1, 0, 0] = sv_end
    return SimpleNamespace(sv=sv, positions=np.array([256, 300]))


def test_spectrum_of_a_rank_one_head_draws_only_positive_sigma_and_says_so():
    sv = np.zeros(128, np.float32)
    sv[0] = 3.0
    df = F.spectrum_frame([_capture(sv)], ["doc"], 0, 0)
    assert len(df) == 128 and (df["sigma"] == 0).sum() == 127  # the CSV keeps every value
    chart = F.spectrum_chart(df)
    spec = chart.to_dict()
    drawn = {r["sigma"] for ds in spec["datasets"].values() for r in ds if "sigma" in r}
    assert drawn == {3.0}  # no σ = 0 reaches the log axis (it would blank the axis)
    assert any("127 singular values are 0" in line for line in spec["title"]["subtitle"])
    svg = F.to_svg(chart)
    assert "singular value σ_i (log scale)" in svg and "127 singular values are 0" in svg


def test_spectrum_of_a_full_rank_head_has_no_zero_note():
    sv = np.geomspace(1.0, 1e-6, 128).astype(np.float32)
    chart = F.spectrum_chart(F.spectrum_frame([_capture(sv)], ["doc"], 0, 0))
    assert not any("singular value" in line and "are 0" in line for line in chart.to_dict()["title"]["subtitle"])
