"""The Loss vs rank page's pure helpers: seed 000's table layout (uniform ranks, rank maps, empty subsets, one
document), the short-document messages, the list of previous results."""
import math

import pandas as pd

from gdnviz.probes.loss_sweep import ROW_COLUMNS, loss_table
from gdnviz.store import Store
from gdnviz.ui import loss as LS


def row(doc, setting, r, all_, any_, recent):
    """One (document, setting) row: (n, loss) per subset; n = 0 leaves the loss NaN."""
    d = dict(doc=doc, document=f"d{doc}", n_tokens=100, setting=setting, r=r)
    for sub, (n, x) in zip(("all", "copy_any", "copy_recent"), (all_, any_, recent)):
        d[f"n_{sub}"], d[f"loss_{sub}"] = n, (x if n else float("nan"))
    return d


def frame(rows):
    df = pd.DataFrame(rows, columns=ROW_COLUMNS)
    df["r"] = df["r"].astype("Int64")
    return df


def test_seed000_table_layout():
    none = (0, 0)  # no prediction in the strict copy subset
    rows = frame([row(0, "uniform", 4, (99, 2.2), (10, 1.5), none), row(1, "uniform", 4, (99, 3.3), (5, 1.0), none),
                  row(0, "uniform", 16, (99, 2.0), (10, 1.0), none), row(1, "uniform", 16, (99, 3.0), (5, 1.0), none),
                  row(0, "early", None, (99, 2.1), (10, 1.2), none), row(1, "early", None, (99, 3.1), (5, 1.0), none)])
    t = LS.seed000_table(loss_table(rows), 16)
    assert t["r"].tolist() == ["4", "16 (untouched)", "map early"]
    # r = 4: differences 0.2 and 0.3 -> mean 0.25, SE = std([0.2, 0.3], ddof=1) / sqrt(2) = 0.05
    assert list(t.columns) == ["r", "all: loss", "all: Δ ± SE (Δ %)", "copy (any): loss",
                               "copy (any): Δ ± SE (Δ %)", "copy (recent): loss", "copy (recent): Δ ± SE (Δ %)"]
    assert t["all: loss"][0] == "2.7500" and t["all: Δ ± SE (Δ %)"][0] == "+0.2500 ± 0.0500 (+10.00%)"
    assert t["all: Δ ± SE (Δ %)"][1] == "0" and t["copy (recent): loss"].tolist() == ["—"] * 3
    assert t["copy (recent): Δ ± SE (Δ %)"].tolist() == ["—"] * 3
    assert t["copy (any): Δ ± SE (Δ %)"][2] == "+0.1000 ± 0.1000 (+10.00%)"  # differences 0.2, 0 on 1.0, 1.0
    sizes = LS.subset_sizes(loss_table(rows))
    assert sizes == {"all": (2, 198), "copy_any": (2, 15), "copy_recent": (0, 0)}
    one = LS.seed000_table(loss_table(rows[rows.doc == 0]), 16)
    assert one["all: Δ ± SE (Δ %)"][0] == "+0.2000 (1 document: no SE) (+10.00%)"
    assert math.isclose(loss_table(rows[rows.doc == 0])["delta"][0], 0.2)


def test_short_documents_and_previous_results(tmp_path):
    docs = [dict(name="long", n_tokens=300), dict(name="brief", n_tokens=65), dict(name="edge", n_tokens=66)]
    msgs = LS.short_documents(docs, 64)
    assert len(msgs) == 1 and msgs[0].startswith("Document 'brief' has 65 tokens; loss vs rank needs at least 66")
    assert LS.default_ranks_text(128) == "1, 4, 12, 32" and LS.default_ranks_text(16) == "1, 4, 12"
    store = Store(tmp_path)
    assert LS.previous_loss_sweeps(store) == []
    jid = store.submit("loss", dict(heads="all", min_distance=512, rank_maps=[]))
    store.update_job(jid, status="done", finished=1.0, result=dict(model_name="/m/demo", documents=[{}, {}],
                                                                   ranks=[1, 4, 128]))
    store.submit("sweep", {})
    (p,) = LS.previous_loss_sweeps(store)
    assert p["id"] == jid and "demo · 2 documents · r = 1, 4, 128 · heads: all · d = 512" in p["label"]
