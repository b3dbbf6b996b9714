"""What a run's zip holds besides its figures: the results of the jobs that belong to the run, a README and a
script that reloads the files with pandas and redraws the main figure.

A finished job *belongs to* a run when it ran on the run's model (same weights fingerprint and dtype) at the run's
segment length L; a loss-vs-rank job, and a truncation that measured a loss, only when its documents are the run's
documents. ``job_records(store, run)`` lists them, oldest first; ``run_files(store, run)`` gives every extra file
of the zip as {path in the zip: bytes}:

- ``jobs.csv``: one row per job included (id, kind, finished, folder);
- ``truncations.csv`` + ``truncations/<id>.json``: the Truncate & compare results;
- ``sweeps/<id>/table.csv | rows.csv | settings.json``, ``scans/<id>/…``, ``loss/<id>/…``,
  ``budgets/<id>/summary.json | curve.csv``;
- ``README.txt`` (every file, its columns and units) and ``redraw.py`` (pandas + altair, run in the unzipped
  folder or pasted into a notebook);
- ``reload_with_gdnviz.py``: a notebook snippet that reopens the run's stored captures with the library, from the
  cache folder the run was made in (``reload_py``).
"""
from __future__ import annotations

import json
import time

import pandas as pd

__all__ = ["job_records", "run_files", "reload_py", "redraw_py"]

KINDS = ("truncate", "sweep", "scan", "budget", "loss")


def _model_of(res: dict) -> tuple[str | None, str | None]:
    m = res.get("model")
    if isinstance(m, dict):
        return m.get("fingerprint"), res.get("dtype") or m.get("dtype")
    return res.get("fingerprint"), res.get("dtype")


def _docs(d) -> list:
    return [[str(n), str(t)] for n, t in (d or ())]


def belongs(rec: dict, run: dict) -> bool:
    """True when the finished job ``rec`` belongs to ``run`` (the module docstring's rule)."""
    if rec.get("kind") not in KINDS or rec.get("status") != "done" or not isinstance(rec.get("result"), dict):
        return False
    spec, res = rec.get("spec") or {}, rec["result"]
    fp, dtype = _model_of(res)
    if fp != run["model"].get("fingerprint") or dtype != run.get("dtype", run["model"].get("dtype")):
        return False
    if int(spec.get("segment_len", -1)) != int(run["segment_len"]):
        return False
    docs = _docs(spec.get("documents") if rec["kind"] == "loss" else spec.get("loss_documents"))
    if not docs:
        return rec["kind"] != "loss"
    return docs == _docs(run["spec"].get("documents"))


def job_records(store, run: dict) -> list[dict]:
    """The finished jobs of ``store`` (a ``gdnviz.store.Store``) that belong to ``run``, oldest first."""
    recs = [r for r in store.read_jobs()[0] if belongs(r, run)]
    return sorted(recs, key=lambda r: r.get("finished") or 0)


def _json(obj) -> bytes:
    return json.dumps(obj, indent=2, default=str).encode()


def _csv(df: pd.DataFrame) -> bytes:
    return df.to_csv(index=False).encode()


def _settings(rec: dict, drop: tuple) -> bytes:
    res = {k: v for k, v in rec["result"].items() if k not in drop}
    return _json(dict(job=rec["id"], finished=rec.get("finished"), spec=rec.get("spec"), result=res))


def _truncation_row(rec: dict) -> dict:
    res, sp = rec["result"], rec.get("spec") or {}
    lo, sc = res.get("loss") or {}, res.get("scores") or {}
    return dict(job=rec["id"], finished=_when(rec), n_heads=res.get("n_heads"),
                ranks=" ".join(f"{l}:{h}:{r}" for l, h, r in res.get("ranks", [])),
                task=res.get("task") or "", target_len=sp.get("target_len") if res.get("task") else None,
                prompt_tokens=res.get("prompt_tokens"), boundaries_in_prompt=res.get("boundaries_in_prompt"),
                max_new_tokens=res.get("max_new_tokens"), score_untouched=sc.get("untouched"),
                score_truncated=sc.get("truncated"), loss_untouched=lo.get("untouched"),
                loss_truncated=lo.get("truncated"), loss_delta=lo.get("delta"), n_documents=lo.get("n_documents"),
                text_untouched=res.get("untouched", {}).get("text"),
                text_truncated=res.get("truncated", {}).get("text"))


def _when(rec: dict) -> str:
    t = rec.get("finished")
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t)) if t else ""


def _job_files(rec: dict) -> dict[str, bytes]:
    from gdnviz.probes import budget, loss_sweep, scan, sweep

    kind, res, jid = rec["kind"], rec["result"], rec["id"]
    if kind == "truncate":
        return {f"truncations/{jid}.json": _json(dict(job=jid, spec=rec.get("spec"), result=res))}
    if kind == "sweep":
        return {f"sweeps/{jid}/table.csv": _csv(sweep.csv_frame(sweep.table_frame(res["table"]))),
                f"sweeps/{jid}/rows.csv": _csv(sweep.csv_frame(sweep.rows_frame(res["rows"]))),
                f"sweeps/{jid}/settings.json": _settings(rec, ("table", "rows"))}
    if kind == "scan":
        return {f"scans/{jid}/table.csv": _csv(scan.table_frame(res["table"])),
                f"scans/{jid}/settings.json": _settings(rec, ("table",))}
    if kind == "loss":
        return {f"loss/{jid}/table.csv": _csv(loss_sweep.table_frame(res["table"])),
                f"loss/{jid}/rows.csv": _csv(loss_sweep.rows_frame(res["rows"])),
                f"loss/{jid}/settings.json": _settings(rec, ("table", "rows"))}
    return {f"budgets/{jid}/summary.json": _json(dict(job=jid, spec=rec.get("spec"), budgets=res["budgets"])),
            f"budgets/{jid}/curve.csv": _csv(budget.curve_frame_from_records(res["curve"]))}


FOLDER = {"truncate": "truncations", "sweep": "sweeps", "scan": "scans", "loss": "loss", "budget": "budgets"}


def run_files(store, run: dict) -> dict[str, bytes]:
    """Every file the run's zip holds besides figures/, data/, tables/ and settings.json (module docstring)."""
    recs = job_records(store, run)
    out: dict[str, bytes] = {}
    index = []
    for rec in recs:
        files = _job_files(rec)
        out.update(files)
        index.append(dict(job=rec["id"], kind=rec["kind"], finished=_when(rec), label=rec.get("label", ""),
                          files=" ".join(sorted(files))))
    out["jobs.csv"] = _csv(pd.DataFrame(index, columns=["job", "kind", "finished", "label", "files"]))
    trunc = [_truncation_row(r) for r in recs if r["kind"] == "truncate"]
    if trunc:
        out["truncations.csv"] = _csv(pd.DataFrame(trunc))
    out["README.txt"] = readme(run, {r["kind"] for r in recs}).encode()
    out["redraw.py"] = redraw_py(run["model"]["gdn_layers"]).encode()
    out["reload_with_gdnviz.py"] = reload_py(run, store.dir).encode()
    return out


def reload_py(run: dict, cache_dir) -> str:
    """A notebook snippet that reopens ``run`` with the gdnviz library from ``cache_dir`` (the store it is in): its
    CaptureResults, the head table over its documents and the overview numbers."""
    return f'''"""Reopen gdnviz run {run['run_id']} with the gdnviz library (a notebook cell, or `python reload_with_gdnviz.py`
with gdnviz importable): the stored captures, i.e. every GDN head's state spectra at every segment boundary of each
document, from the cache folder the run was made in. Change CACHE if that folder moved; to recompute the run
elsewhere, capture the same documents with `gdnviz.capture.capture_document` (README of gdnviz, "The library")."""
from gdnviz import summary
from gdnviz.jobs import load_run_captures
from gdnviz.store import Store

CACHE = {str(cache_dir)!r}
RUN_ID = {run['run_id']!r}

store = Store(CACHE)
run = store.run(RUN_ID)
if run is None:
    raise SystemExit(f"run {{RUN_ID}} is not in {{CACHE}}: set CACHE to the folder the app stored it in")
captures = load_run_captures(store, run)  # one gdnviz.capture.CaptureResult per document, in run order
table = summary.document_set_table(captures)  # per head: each statistic's median, min and max over documents
overview = summary.overview(table, run["segment_len"])
print(f"run {{RUN_ID}}: {{len(captures)}} document(s), {{len(table)}} heads, "
      f"Spearman rho(erank, horizon) = {{overview['spearman_erank_horizon']:.4f}}")
'''


def readme(run: dict, kinds: set) -> str:
    """The zip's README: what the run is, which jobs belong to it, every file with its columns and units."""
    name = str(run.get("model_name") or run["model"].get("name"))
    docs = ", ".join(f"{d['name']} ({int(d['n_tokens']):,} tokens)" for d in run.get("documents", []))
    parts = [f"""gdnviz run {run['run_id']}
model {name} (fingerprint {run['model'].get('fingerprint')}, {run.get('dtype')} on {run.get('device')}), segment
length L = {run['segment_len']} tokens, documents: {docs}.

Scores are RULER string-match scores in % (0-100) per sample, means over samples; differences (delta) and their
paired standard errors (se) are in percentage points, paired over the same samples. Losses are mean next-token
negative log-likelihoods in nats per token. Lengths and positions are in tokens; r is the rank kept per head
(r = min(d_k, d_v) is the untouched model). Timestamps are UTC.

settings.json          the run's settings and its overview numbers (Spearman rho of erank vs horizon with its
                       95% bootstrap interval over heads, share of heads forgetting within a segment).
tables/heads.csv       one row per GDN head (layer, head): each statistic as the median over the documents
                       (<metric>), with <metric>_min / <metric>_max over documents and n_docs. erank,
                       numerical_rank, stable_rank, energy_rank99 are in directions (out of min(d_k, d_v));
                       energy_top<r> is the share (0-1) of the state's squared Frobenius norm in its top r
                       directions; horizon = 1/(1 - mean alpha) in tokens; state_norm is a Frobenius norm.
figures/<name>.png|svg the figures as the app draws them; data/<name>.csv the numbers each is drawn from.
jobs.csv               the jobs below, one row each: id, kind, finished, label, their files. A job belongs to this
                       run when it ran on this model (same fingerprint and dtype) at L = {run['segment_len']}; a loss
                       run, and a truncation that measured a loss, only on this run's documents.
redraw.py              reloads these files with pandas and redraws the main figure (effective rank vs decay
                       horizon per head) and, when there are sweeps, score vs r: `python redraw.py` in the unzipped
                       folder (writes redrawn_*.html), or paste it into a notebook cell.
reload_with_gdnviz.py  reopens the run itself with the gdnviz library (its captures, the head table, the overview)
                       from the cache folder it was made in (CACHE at its top): a notebook cell.
"""]
    if not kinds:
        parts.append("No truncation, sweep, scan, budget or loss run of this model at this L is in the cache yet.\n")
    if "truncate" in kinds:
        parts.append("""\
truncations.csv        one row per Truncate & compare run: job, finished, n_heads, ranks (layer:head:r, space-
                       separated), task (empty: a typed prompt), target_len and prompt_tokens (tokens),
                       boundaries_in_prompt, max_new_tokens, score_untouched / score_truncated (%, RULER tasks
                       only), loss_untouched / loss_truncated / loss_delta (nats/token, mean of per-document means
                       over n_documents documents; empty when not measured), the two generated texts.
truncations/<id>.json  the whole result of that run (prompt, answers, per-document losses and the loss change along
                       each document, block-averaged).
""")
    if "sweep" in kinds:
        parts.append("""\
sweeps/<id>/table.csv  seed 000's table: per (task, length, setting, r) score (%), n samples, untouched (%, the
                       same samples), delta and se (points). setting "uniform": the chosen heads at rank r; else
                       the name of a per-head rank map (r empty).
sweeps/<id>/rows.csv   one row per (task, length, setting, r, seed): score (0 or 100 for one-answer tasks), pred
                       (the generated text), answers (JSON list), n_tokens (the prompt), n_generated.
sweeps/<id>/settings.json  the job's spec and the result's metadata.
""")
    if "scan" in kinds:
        parts.append("""\
scans/<id>/table.csv   one row per unit (a layer, or a head when head is set): r, n, score (%), baseline (%: the
                       untouched model, or every head at r in keep-one mode), delta and se (points, paired).
scans/<id>/settings.json   the scan's spec and the result's metadata (untouched and all-cut scores, %).
""")
    if "budget" in kinds:
        parts.append("""\
budgets/<id>/summary.json  each budget: per-head ranks, the tests per (task, length), the held-out check and
                       the recurrent-state bytes per sequence.
budgets/<id>/curve.csv  score vs recurrent-state memory: tolerance (points), state_kib (KiB per sequence),
                       samples ("search" or "held-out"), task, length, score / untouched (%), delta / se (points), n.
""")
    if "loss" in kinds:
        parts.append("""\
loss/<id>/table.csv    seed 000's loss table: per (setting, r, subset) n_docs, n_predictions, loss and untouched
                       (nats/token, documents weighted equally), delta and se (nats/token, paired over documents),
                       delta_pct (% of untouched). subset "all" or a copy/induction subset.
loss/<id>/rows.csv     one row per (document, setting, r): n_<subset> predictions and loss_<subset> (nats/token).
loss/<id>/settings.json    the job's spec and the result's metadata.
""")
    return "\n".join(parts)


_REDRAW_PY = '''\
"""Reload this gdnviz run's files with pandas and redraw its main figure: effective rank vs decay horizon per
head (log-log, one colour per layer, the min-max over documents as bars), and score vs r for each sweep.
Run it in the unzipped folder (`python redraw.py`: writes redrawn_*.html) or paste it into a notebook cell."""
import json
from pathlib import Path

import altair as alt
import pandas as pd

HERE = Path(__file__).resolve().parent if "__file__" in globals() else Path.cwd()
settings = json.loads((HERE / "settings.json").read_text())
heads = pd.read_csv(HERE / "tables" / "heads.csv")
jobs = pd.read_csv(HERE / "jobs.csv")
print(f"run {settings['run_id']}: {len(heads)} heads, {len(jobs)} job(s) of this run")

x = alt.X("horizon:Q", scale=alt.Scale(type="log"), title="decay horizon 1/(1 − ᾱ) (tokens, log scale)")
y_scale = alt.Scale(type="log")
y = alt.Y("erank:Q", scale=y_scale, title="effective rank (directions, log scale)")
LAYER_COLORS = __LAYER_COLORS__  # the app's layer palette (gdnviz.plotstyle): neighbouring layers told apart
layer = alt.Color("layer:N", title="layer",
                  scale=alt.Scale(domain=list(LAYER_COLORS), range=list(LAYER_COLORS.values())))
bars = alt.Chart(heads).mark_rule(opacity=0.5).encode(x=x, y=alt.Y("erank_min:Q", scale=y_scale), y2="erank_max:Q",
                                                      color=layer)
points = alt.Chart(heads).mark_circle(size=60, opacity=0.9).encode(x=x, y=y, color=layer,
                                                                   tooltip=["layer", "head", "erank", "horizon"])
rho = settings.get("overview", {}).get("spearman_erank_horizon")
title = "effective rank vs decay horizon" + (f" (Spearman ρ = {rho:.2f})" if rho is not None else "")
(bars + points).properties(title=title, width=480, height=360).save(str(HERE / "redrawn_erank_vs_horizon.html"))

for table in sorted(HERE.glob("sweeps/*/table.csv")):
    t = pd.read_csv(table)
    t = t[t["setting"] == "uniform"]
    fig = alt.Chart(t).mark_line(point=True).encode(
        x=alt.X("r:Q", scale=alt.Scale(type="log", domain=[t["r"].min() / 1.3, t["r"].max() * 1.3], nice=False),
                axis=alt.Axis(values=sorted(t["r"].unique().tolist()), format="d"),
                title="rank r kept per head (log scale; the largest is the untouched model)"),
        y=alt.Y("score:Q", scale=alt.Scale(domain=[0, 100]), title="RULER score (%)"),
        color=alt.Color("task:N", title="task"), column=alt.Column("length:O", title="length (tokens)"))
    name = table.parent.name
    fig.properties(title=f"sweep {name}: score vs r").save(str(HERE / f"redrawn_sweep_{name}.html"))
    print(f"sweep {name}: {len(t)} (task, length, r) rows")
'''


def redraw_py(layers) -> str:
    """redraw.py for a run whose head table holds ``layers`` (its GDN layer indices): the script carries the app's
    layer colours (``plotstyle.layer_colors`` over those layers, in order) as values, so it needs no gdnviz."""
    from gdnviz.plotstyle import layer_colors

    dom = sorted({int(x) for x in layers})
    return _REDRAW_PY.replace("__LAYER_COLORS__", repr(dict(zip(dom, layer_colors(len(dom))))))
