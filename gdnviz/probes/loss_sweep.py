"""Loss vs rank over a document set (seed 000 §3, "Perplexity says the residue is dead"), memoised per document.

``run_loss_sweep(lm, documents, LossSweepSpec(...), store=DIR)`` runs every document once per setting: the
untouched model (r = min(d_k, d_v)), each uniform r on the chosen heads (default r = 1, 4, 12, 32 below the
untouched rank) and each named per-head rank map. The per-token losses (``gdnviz.probes.loss.token_nll``) of one
(document, setting) are stored under :func:`doc_key` (model fingerprint, dtype, device type, the document's token
ids, the truncation, segment length, ``VERSION``) as soon as they are computed, so an interrupted sweep resumes
where it stopped, a repeated one recomputes nothing, and the untouched losses of a document are computed once and
reused by every head set, rank list and copy-subset distance. The device type is in the key because the fla and
torch paths differ by more than a small loss change: a paired difference must not mix them.

Each (document, setting) to compute is one ``LossUnit``, answered by an executor as ``gdnviz.probes.sweep``'s
batches are (``sweep.local_executor`` in this process by default, ``gdnviz.cluster``'s on a Dask cluster); only
this process writes the store.

Returns one row per (document, setting) with the mean loss of that document on all its predictions and on each
copy/induction subset (``gdnviz.probes.loss.copy_mask``, readings "any" and "recent", ``min_distance`` tokens).

``loss_table`` gives seed 000's table. **Documents are weighted equally**: per (setting, subset) the loss is the
mean over documents of each document's mean next-token loss, and Δ is the mean over documents of the per-document
differences D_d = loss_d(setting) − loss_d(untouched), with the paired standard error std(D, ddof=1) / sqrt(n_docs)
(NaN for one document). On a copy subset only the documents with at least one prediction in it count (n_docs says
how many). ``loss_figure`` draws the loss and Δ ± SE vs r.
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import asdict, dataclass
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import pandas as pd

from gdnviz import runner
from gdnviz.errors import DocumentTooShort, EmptyDocumentSet
from gdnviz.probes.loss import COPY_READINGS, copy_mask, token_nll
from gdnviz.probes.memo import MemoStore
from gdnviz.probes.sweep import UNIFORM, local_executor, resolve_heads, resolve_ranks
from gdnviz.store import content_hash
from gdnviz.truncation import TruncationSpec

__all__ = ["LossSweepSpec", "LossUnit", "VERSION", "SUBSETS", "SUBSET_LABELS", "ROW_COLUMNS", "TABLE_COLUMNS",
           "doc_key", "min_tokens", "run_loss_sweep", "loss_table", "loss_figure", "rows_frame", "table_frame"]

VERSION = 1  # of a (document, setting) entry's computation: bump it to invalidate every stored entry
#: Subsets of the predictions: all of them, and the copy/induction subset in each reading of ``copy_mask``.
SUBSETS = ("all",) + tuple(f"copy_{r}" for r in COPY_READINGS)
SUBSET_LABELS = {"all": "all tokens", "copy_any": "copy: any earlier occurrence > d back",
                 "copy_recent": "copy: most recent occurrence > d back"}
ROW_COLUMNS = ["doc", "document", "n_tokens", "setting", "r"] + [c for s in SUBSETS for c in (f"n_{s}", f"loss_{s}")]
TABLE_COLUMNS = ["setting", "r", "subset", "n_docs", "n_predictions", "loss", "untouched", "delta", "se",
                 "delta_pct"]


@dataclass(frozen=True)
class LossSweepSpec:
    """What to run over the documents. Hashable and JSON-friendly (``to_dict``).

    ranks: r values (None: 1, 4, 12, 32 below min(d_k, d_v)); the untouched r = min(d_k, d_v) is always added.
    heads: "all", "layers:0,1", "L:H,L:H" or a tuple of (layer, head): the heads cut to each uniform r.
    rank_maps: ((name, ((layer, head, r), ...)), ...) or {name: {(layer, head): r}}: extra settings (``r`` empty).
    segment_len: tokens per segment (truncation at absolute positions L, 2L, ...). min_distance: d of the copy
    subsets (tokens). fingerprint: when given, the model must have it.
    """

    model: str = ""
    ranks: tuple | None = None
    heads: Any = "all"
    rank_maps: tuple = ()
    segment_len: int = runner.DEFAULT_SEGMENT_LEN
    min_distance: int = 512
    fingerprint: str | None = None

    def __post_init__(self):
        if self.ranks is not None:
            object.__setattr__(self, "ranks", tuple(self.ranks))
        if not isinstance(self.heads, str):
            object.__setattr__(self, "heads", tuple(tuple(int(x) for x in lh) for lh in self.heads))
        maps = self.rank_maps.items() if isinstance(self.rank_maps, Mapping) else self.rank_maps
        object.__setattr__(self, "rank_maps", tuple(
            (str(name), tuple(tuple(e) for e in TruncationSpec(m).to_list())) for name, m in maps))

    def to_dict(self) -> dict:
        d = asdict(self)
        d["ranks"] = None if self.ranks is None else list(self.ranks)
        d["heads"] = self.heads if isinstance(self.heads, str) else [list(x) for x in self.heads]
        d["rank_maps"] = {name: [list(e) for e in m] for name, m in self.rank_maps}
        return d


@dataclass(frozen=True)
class _Setting:
    name: str
    r: int | None
    spec: TruncationSpec | None  # None: untouched


def _rmax(info) -> int:
    return min(info.d_k, info.d_v)


def min_tokens(segment_len: int) -> int:
    """The fewest tokens a document needs: L + 2, so that at least one prediction (of token L + 1, from token L)
    reads a state truncated at the first boundary."""
    return int(segment_len) + 2


def _check(spec: LossSweepSpec, info, documents) -> list[tuple[str, list[int]]]:
    """Validated (name, token ids) pairs; raises before anything runs."""
    runner.check_segment_len(spec.segment_len)
    md = spec.min_distance
    if isinstance(md, bool) or not isinstance(md, (int, np.integer)) or md < 0:
        raise ValueError(f"the copy-subset distance must be a whole number of tokens ≥ 0, got {md!r}")
    if spec.fingerprint and spec.fingerprint != info.fingerprint:
        raise ValueError(f"the loss sweep was set up for model fingerprint {spec.fingerprint}, but the loaded "
                         f"model's is {info.fingerprint}")
    resolve_ranks(spec.ranks, _rmax(info))
    resolve_heads(spec.heads, info)
    for name, m in spec.rank_maps:
        if name == UNIFORM:
            raise ValueError(f"a rank map cannot be called {UNIFORM!r}")
        TruncationSpec(m).validate(info)
    docs = [(str(n), [int(t) for t in ids]) for n, ids in documents] if documents is not None else []
    if not docs:
        raise EmptyDocumentSet("loss vs rank needs at least one document: capture a document set first, or pass "
                               "documents")
    need = min_tokens(spec.segment_len)
    for name, ids in docs:
        if len(ids) < need:
            raise DocumentTooShort(
                f"document {name!r} has {len(ids):,} tokens; loss vs rank needs at least {need:,} (segment length "
                f"L = {spec.segment_len} + 2), so that some prediction reads a state truncated at the first "
                "boundary. Use a longer document or a shorter segment length.")
    return docs


def _settings(spec: LossSweepSpec, info) -> list[_Setting]:
    rmax, heads = _rmax(info), resolve_heads(spec.heads, info)
    ranks = resolve_ranks(spec.ranks, rmax)
    out = [_Setting(UNIFORM, r, None if r == rmax else TruncationSpec.uniform(heads, r)) for r in ranks]
    return out + [_Setting(name, None, TruncationSpec(m)) for name, m in spec.rank_maps]


def doc_key(info, ids: Sequence[int], trunc: TruncationSpec | None, segment_len: int) -> str:
    """Memo key of one document's per-token losses under one truncation (``"lossdoc:<hash>"``; None: untouched,
    shared by every head set)."""
    d = dict(v=VERSION, fp=info.fingerprint, dtype=info.dtype, device=info.memo_device,
             ids=hashlib.sha256(np.asarray(list(ids), dtype=np.int64).tobytes()).hexdigest(), n=len(ids),
             trunc=None if trunc is None else trunc.to_list(), L=int(segment_len))
    return "lossdoc:" + content_hash(dict(version=f"loss-docs-v{VERSION}", entry=d))


def _decode(value, n: int) -> np.ndarray | None:
    """Stored bytes -> [n] float64, or None when absent or of the wrong size (recomputed then)."""
    if not isinstance(value, (bytes, bytearray)) or len(value) != 8 * n:
        return None
    return np.frombuffer(bytes(value), dtype="<f8").copy()


def _label(setting: _Setting, rmax: int) -> str:
    if setting.name != UNIFORM:
        return f"rank map {setting.name!r}"
    return f"r = {setting.r}" + (" (untouched)" if setting.r == rmax else "")


@dataclass(frozen=True)
class LossUnit:
    """One unit of work: document ``doc``'s token ids under setting ``slot`` (``trunc``; None: untouched), stored
    under memo ``key``. ``answer(lm)``: its per-token losses, [len(ids) - 1] float64 nats (``token_nll``)."""

    doc: int
    slot: int
    key: str
    ids: tuple
    trunc: TruncationSpec | None
    segment_len: int

    @property
    def size(self) -> int:
        """Answers in the unit: one (document, setting) run."""
        return 1

    def answer(self, lm) -> np.ndarray:
        return token_nll(lm, list(self.ids), segment_len=self.segment_len, spec=self.trunc)


def _row(i: int, name: str, n: int, s: _Setting, masks: dict, nll: np.ndarray) -> dict:
    row = dict(doc=i, document=name, n_tokens=n, setting=s.name, r=s.r)
    for sub, m in masks.items():
        k = int(m.sum())
        row[f"n_{sub}"], row[f"loss_{sub}"] = k, float(nll[m].mean()) if k else float("nan")
    return row


def run_loss_sweep(lm, documents: Sequence[tuple[str, Sequence[int]]], spec: LossSweepSpec, store=None,
                   progress: Callable[[int, int], None] | None = None,
                   describe: Callable[[str], None] | None = None, executor=None) -> pd.DataFrame:
    """Run (or resume) the sweep over ``documents`` ((name, token ids) pairs); one row per (document, setting)
    (``ROW_COLUMNS``: ``loss_<subset>`` the document's mean loss in nats on that subset, NaN when it is empty, and
    ``n_<subset>`` its number of predictions), documents in order, settings in order within each.

    store: a directory (a ``diskcache.Cache`` is opened there), a mapping-like cache (``get`` and item assignment;
    values are the float64 bytes of the per-token losses) or None (no memo). progress(done, total) is called once
    for the memo's entries and after every computed (document, setting), once its losses are stored, so a progress
    callback that raises (a cancel) loses nothing finished. describe(text) says which (document, setting) is handed
    to the executor next. executor: None (``sweep.local_executor(lm)``) or ``gdnviz.cluster``'s; ``lm`` needs only
    ``info`` when another executor answers. Raises EmptyDocumentSet, DocumentTooShort, RankOutOfRange,
    BadSegmentLength or ValueError before running anything.
    """
    info = lm.info
    docs = _check(spec, info, documents)
    settings = _settings(spec, info)
    rmax = _rmax(info)
    execute = executor if executor is not None else local_executor(lm)
    masks = []
    for _, ids in docs:
        m = {"all": np.ones(len(ids) - 1, dtype=bool)}
        m.update({f"copy_{r}": copy_mask(ids, spec.min_distance, r) for r in COPY_READINGS})
        masks.append(m)
    st = MemoStore(store)
    rows, todo, total = {}, [], len(docs) * len(settings)  # rows: (doc, slot) -> row
    try:
        for i, (name, ids) in enumerate(docs):
            for j, s in enumerate(settings):
                key = doc_key(info, ids, s.spec, spec.segment_len)
                nll = _decode(st.get(key), len(ids) - 1)
                if nll is None:
                    todo.append(LossUnit(i, j, key, tuple(ids), s.spec, int(spec.segment_len)))
                else:
                    rows[(i, j)] = _row(i, name, len(ids), s, masks[i], nll)
        done = len(rows)
        if progress is not None and done:
            progress(done, total)

        def units():
            for u in todo:
                if describe is not None:
                    name, ids = docs[u.doc]
                    describe(f"document {u.doc + 1}/{len(docs)} '{name}' ({len(ids):,} tokens) · "
                             f"{_label(settings[u.slot], rmax)}")
                yield u

        for u, nll in execute(units()):
            nll = np.asarray(nll, dtype=np.float64)
            st.set(u.key, nll.astype("<f8").tobytes())
            name, ids = docs[u.doc]
            rows[(u.doc, u.slot)] = _row(u.doc, name, len(ids), settings[u.slot], masks[u.doc], nll)
            done += 1
            if progress is not None:
                progress(done, total)
    finally:
        st.close()
    df = pd.DataFrame([rows[k] for k in sorted(rows)], columns=ROW_COLUMNS)
    df["r"] = df["r"].astype("Int64")
    return df


# --- the table and the figure -------------------------------------------------------------------------------------
def loss_table(rows: pd.DataFrame, rmax: int | None = None) -> pd.DataFrame:
    """Seed 000's table in long form (``TABLE_COLUMNS``), one row per (setting, r, subset), documents weighted
    equally (module docstring): n_docs documents with a prediction in the subset, n_predictions their predictions
    in it, loss = mean of the per-document mean losses (nats / token), untouched = the same for the untouched model,
    delta = mean of the per-document differences, se = their std (ddof=1) / sqrt(n_docs) (NaN when n_docs < 2),
    delta_pct = 100 · delta / untouched. The untouched rows are the uniform setting at ``rmax`` (default: the
    largest uniform r)."""
    if rows is None or len(rows) == 0:
        raise EmptyDocumentSet("no loss rows to tabulate")
    uni = rows[rows["setting"] == UNIFORM]
    if uni.empty:
        raise ValueError("the rows hold no uniform-rank setting, so there is no untouched baseline")
    rmax = int(uni["r"].max()) if rmax is None else int(rmax)
    base = uni[uni["r"] == rmax].set_index("doc")
    missing = sorted(set(rows["doc"]) - set(base.index))
    if missing:
        raise ValueError(f"no untouched (r = {rmax}) losses for documents {missing[:3]}: paired differences need "
                         "them")
    out = []
    for (setting, r), g in rows.groupby(["setting", "r"], dropna=False, sort=False):
        g = g.set_index("doc")
        for sub in SUBSETS:
            ok = (g[f"n_{sub}"] > 0).to_numpy()
            x = g.loc[ok, f"loss_{sub}"].to_numpy(float)
            u = base.loc[g.index[ok], f"loss_{sub}"].to_numpy(float)
            n = int(ok.sum())
            d = x - u
            rec = dict(setting=setting, r=r, subset=sub, n_docs=n, n_predictions=int(g.loc[ok, f"n_{sub}"].sum()))
            if n:
                loss, unt, delta = float(x.mean()), float(u.mean()), float(d.mean())
                rec.update(loss=loss, untouched=unt, delta=delta,
                           se=float(np.std(d, ddof=1) / math.sqrt(n)) if n > 1 else float("nan"),
                           delta_pct=100.0 * delta / unt if unt else float("nan"))
            else:
                rec.update(loss=float("nan"), untouched=float("nan"), delta=float("nan"), se=float("nan"),
                           delta_pct=float("nan"))
            out.append(rec)
    t = pd.DataFrame(out, columns=TABLE_COLUMNS)
    t["r"] = t["r"].astype("Int64")
    t["_u"] = t["setting"] != UNIFORM
    t["_s"] = t["subset"].map({s: i for i, s in enumerate(SUBSETS)})
    t = t.sort_values(["_u", "r", "setting", "_s"], na_position="last").drop(columns=["_u", "_s"])
    return t.reset_index(drop=True)


def loss_figure(table: pd.DataFrame, title: str | None = None, min_distance: int | None = None):
    """Altair chart of the uniform-rank rows: left, mean next-token loss vs r (log x), one line per subset; right,
    Δ vs the untouched model with error bars ± the paired standard error over documents."""
    import altair as alt

    from gdnviz.figures import configure

    df = table[(table["setting"] == UNIFORM) & (table["n_docs"] > 0)].copy()
    df["r"] = df["r"].astype(int)
    se = df["se"].fillna(0.0)
    df["lo"], df["hi"] = df["delta"] - se, df["delta"] + se
    d_txt = f" (d = {min_distance} tokens)" if min_distance is not None else ""
    df["subset_label"] = df["subset"].map(SUBSET_LABELS)
    rmax, n_docs = int(df["r"].max()), int(df.loc[df["subset"] == "all", "n_docs"].max())
    rs = sorted(df["r"].unique().tolist())  # a little room left and right, so the end points are not on the axes
    x = alt.X("r:Q", scale=alt.Scale(type="log", base=2, domain=[rs[0] / 1.25, rs[-1] * 1.25], nice=False),
              title="rank r kept per head (log scale)",
              axis=alt.Axis(values=rs, format="d", labelAngle=0))
    color = alt.Color("subset_label:N", title=f"predictions{d_txt}", sort=[SUBSET_LABELS[s] for s in SUBSETS],
                      legend=alt.Legend(orient="bottom", direction="vertical", labelLimit=0, titleLimit=0))
    tip = [alt.Tooltip("subset_label:N", title="subset"), alt.Tooltip("r:Q"),
           alt.Tooltip("loss:Q", format=".4f", title="loss (nats / token)"),
           alt.Tooltip("delta:Q", format="+.4f", title="Δ vs untouched (nats)"),
           alt.Tooltip("se:Q", format=".4f", title="paired SE (nats)"),
           alt.Tooltip("delta_pct:Q", format="+.2f", title="Δ (%)"), alt.Tooltip("n_docs:Q", title="documents"),
           alt.Tooltip("n_predictions:Q", format=",", title="predictions")]
    base = alt.Chart(df)
    left = alt.layer(base.mark_line().encode(x=x, y=alt.Y("loss:Q", title="mean next-token loss (nats / token)",
                                                          scale=alt.Scale(zero=False)), color=color),
                     base.mark_point(filled=True, size=50).encode(x=x, y="loss:Q", color=color, tooltip=tip)
                     ).properties(width=320, height=240, title="loss")
    zero = alt.Chart(pd.DataFrame({"y": [0.0]})).mark_rule(color="#888").encode(y="y:Q")
    dy_title = "Δ loss vs untouched (nats / token)"
    dy = alt.Y("delta:Q", title=dy_title)
    right = alt.layer(zero, base.mark_line().encode(x=x, y=dy, color=color),
                      base.mark_errorbar(ticks=True).encode(x=x, y=alt.Y("lo:Q", title=dy_title), y2="hi:Q",
                                                            color=color),
                      base.mark_point(filled=True, size=50).encode(x=x, y="delta:Q", color=color, tooltip=tip)
                      ).properties(width=320, height=240, title="change vs untouched")
    bars = (f"error bars: ± paired standard error over {n_docs} documents (documents weighted equally)"
            if n_docs > 1 else "one document: no standard errors (use ≥ 2 documents)")
    chart = alt.hconcat(left, right, spacing=36).resolve_scale(y="independent").properties(title=alt.Title(
        title or "Next-token loss vs rank", subtitle=[bars, f"r = {rmax} is the untouched model"]))
    return configure(chart, autosize="pad")


# --- JSON round trip (worker results) -----------------------------------------------------------------------------
def _frame(recs, columns, floats) -> pd.DataFrame:
    df = pd.DataFrame(list(recs), columns=columns)
    df["r"] = pd.array([None if v is None or v is pd.NA or (isinstance(v, float) and math.isnan(v)) else int(v)
                        for v in df["r"]], dtype="Int64")
    for c in floats:
        df[c] = pd.to_numeric(df[c], errors="coerce").astype(float)
    return df


def rows_frame(recs) -> pd.DataFrame:
    """``gdnviz.probes.sweep.records(run_loss_sweep(...))`` back into the rows frame."""
    return _frame(recs, ROW_COLUMNS, [f"loss_{s}" for s in SUBSETS])


def table_frame(recs) -> pd.DataFrame:
    """``gdnviz.probes.sweep.records(loss_table(...))`` back into the table frame (None -> NaN)."""
    return _frame(recs, TABLE_COLUMNS, ["loss", "untouched", "delta", "se", "delta_pct"])
