#!/usr/bin/env python3
"""Measure the demo model the way the model card reports it.

- RULER (gdnviz.probes.ruler): ``generate_many`` on held-out seeds (``--seed0``, default 1,000,000; training
  draws 62-bit random seeds and its in-training evals use 500,000+), our tokenizer, RULER's plain template; free
  greedy decoding through gdnviz (``gdnviz.generate.greedy_generate``: segmented prefill + cached decoding, stop at
  EOS, at most the task's ``tokens_to_generate``); ruler.py's scorer.
- Held-out perplexity: next-token loss on the held-out corpus documents (never trained on), windows of
  ``--ppl-window`` tokens, plus bits per byte.
- ``--no-attention``: the same RULER cells again with every full-attention layer's output zeroed at every position
  (forward hooks on ``self_attn``; the residual stream skips those layers): what the GDN heads answer alone.
- ``--seed000``: seed 000's measurements on this model: per-head effective rank / horizon / key cone on held-out
  documents of ``--seed000-len`` tokens (``gdnviz.capture`` + ``gdnviz.summary``), loss vs rank
  (``gdnviz.probes.loss_sweep``), and RULER answers with every GDN head truncated to rank r; also the
  seconds one 4K capture takes on this machine.

Writes ``--out-json`` and ``--out-md``: the model card's tables (RULER with issue 33's bar and each row's verdict,
attention zeroed, perplexity, loss and answers vs rank, per-head statistics) as one markdown block; the card's
text around them is written by hand. ``--card CARD.md`` also puts that block between CARD.md's two marker lines
(``CARD_BEGIN`` / ``CARD_END``), keeping the hand-written text; ``--card-from EVAL.json`` renders the block from a
saved evaluation without loading a model (nothing is re-measured).

    python scripts/demo/evaluate.py --model gdnviz/assets/demo --n 20 --seed000 --device cpu
    python scripts/demo/evaluate.py --card-from out/demo/eval/v3.json --card scripts/demo/cards/v3.md
"""
from __future__ import annotations

import argparse
import gzip
import json
import math
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]

# Issue 33's bar for a demo model, RULER score (%) at every measured length; fwe is reported, not barred.
BAR = {"niah_single_1": 90.0, "niah_multikey_2": 90.0, "niah_multikey_3": 90.0, "vt": 90.0, "cwe": 50.0}
CARD_BEGIN = "<!-- evaluate.py tables: begin (regenerated, do not edit by hand) -->"
CARD_END = "<!-- evaluate.py tables: end -->"


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=str(ROOT / "gdnviz" / "assets" / "demo"))
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--tasks", default="niah_single_1,niah_multikey_2,niah_multikey_3,vt,cwe,fwe")
    ap.add_argument("--lens", default="2048,4096")
    ap.add_argument("--n", type=int, default=20, help="prompts per task x length")
    ap.add_argument("--seed0", type=int, default=1_000_000)
    ap.add_argument("--heldout", default="out/demo/corpus/heldout.jsonl.gz")
    ap.add_argument("--ppl-window", type=int, default=1024)
    ap.add_argument("--ppl-max-windows", type=int, default=64)
    ap.add_argument("--no-attention", action="store_true",
                    help="also score every RULER cell with the attention layers' outputs zeroed (see docstring)")
    ap.add_argument("--seed000", action="store_true", help="also run seed 000's measurements (see docstring)")
    ap.add_argument("--seed000-docs", type=int, default=4)
    ap.add_argument("--seed000-len", type=int, default=4096)
    ap.add_argument("--seed000-ranks", default="1,4,12,32")
    ap.add_argument("--seed000-tasks", default="niah_single_1,vt")
    ap.add_argument("--seed000-n", type=int, default=10)
    ap.add_argument("--segment-len", type=int, default=256)
    ap.add_argument("--pylib", default=None, help="extra sys.path entry (e.g. a carried wonderwords package)")
    ap.add_argument("--out-json", default="out/demo/eval/eval.json")
    ap.add_argument("--out-md", default=None,
                    help="markdown block (default out/demo/eval/eval.md when evaluating; with --card-from, if given)")
    ap.add_argument("--card", default=None, help="model card whose block between the marker lines is replaced")
    ap.add_argument("--card-from", default=None,
                    help="render the tables from this saved evaluation JSON (no model is loaded or measured)")
    a = ap.parse_args(argv)
    a.tasks = [t for t in a.tasks.split(",") if t]
    a.lens = [int(x) for x in a.lens.split(",") if x]
    a.seed000_ranks = [int(x) for x in a.seed000_ranks.split(",") if x]
    a.seed000_tasks = [t for t in a.seed000_tasks.split(",") if t]
    return a


def heldout_stream(tok, path: Path) -> tuple[list[int], int]:
    docs = [json.loads(x)["text"] for x in gzip.open(path, "rt", encoding="utf-8")]
    ids: list[int] = []
    for d in docs:
        ids += [tok.bos_token_id] + tok(d, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    return ids, sum(len(d.encode()) for d in docs)


def perplexity(lm, ids: list[int], n_bytes: int, window: int, max_windows: int) -> dict:
    import torch

    model, dev = lm.model, lm.device
    n_win = min(max_windows, (len(ids) - 1) // window)
    tot, cnt, covered = 0.0, 0, 0
    with torch.inference_mode():
        for w in range(n_win):
            x = torch.tensor([ids[w * window:w * window + window + 1]], device=dev)
            logits = model(input_ids=x[:, :-1], use_cache=False).logits.float()
            tot += torch.nn.functional.cross_entropy(logits[0], x[0, 1:], reduction="sum").item()
            cnt += window
    covered = cnt / max(1, len(ids) - 1)
    return {"nll": tot / cnt, "ppl": math.exp(tot / cnt), "tokens": cnt, "window": window,
            "bits_per_byte": tot / math.log(2) / (n_bytes * covered) if n_bytes else None}


def ruler_cells(lm, tasks, lens, n, seed0, segment_len, spec=None, log=None) -> tuple[dict, list]:
    from gdnviz.generate import greedy_generate
    from gdnviz.probes import ruler

    scores, rows = {}, []
    for L in lens:
        for task in tasks:
            t0 = time.time()
            samples = ruler.generate_many(task, lm.tokenizer, L, n, seed0=seed0)
            preds = []
            for s in samples:
                g = greedy_generate(lm, s.input_ids, max_new_tokens=s.tokens_to_generate, segment_len=segment_len,
                                    spec=spec)
                preds.append(g.text)
                rows.append({"task": task, "len": L, "seed": s.seed, "n_tokens": s.n_tokens, "answers": s.answers,
                             "pred": g.text, "score": ruler.score(task, [g.text], [s.answers])})
            sc = ruler.score_samples(samples, preds)
            scores.setdefault(task, {})[str(L)] = sc
            if log:
                log(f"{task:16s} @{L:5d}: {sc:6.1f}  (n={len(samples)}, {time.time() - t0:.0f}s)"
                    + (f"  [{spec_name(spec)}]" if spec is not None else ""))
    return scores, rows


class AttentionZeroed:
    """Context manager: every full-attention layer's ``self_attn`` output is zeroed (all positions, every forward
    call, prefill and decoding) while inside; the hooks are removed on exit."""

    def __init__(self, model):
        self.mods = [l.self_attn for l in model.model.layers if getattr(l, "self_attn", None) is not None]
        self.handles = []

    def __enter__(self):
        hook = lambda m, args, out: (out[0] * 0.0,) + tuple(out[1:])  # noqa: E731
        self.handles = [m.register_forward_hook(hook) for m in self.mods]
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()
        self.handles = []


def spec_name(spec) -> str:
    rs = sorted({r for _, r in spec.ranks})
    return f"all GDN heads rank {rs[0]}" if len(rs) == 1 else "mixed ranks"


def seed000(lm, held_ids: list[int], a, log) -> dict:
    import numpy as np

    from gdnviz import summary
    from gdnviz.capture import capture_document
    from gdnviz.truncation import TruncationSpec
    from gdnviz.probes.loss_sweep import LossSweepSpec, loss_table, run_loss_sweep

    L = a.seed000_len
    docs = [held_ids[i * L:(i + 1) * L] for i in range(min(a.seed000_docs, len(held_ids) // L))]
    out: dict = {"docs": len(docs), "doc_tokens": L, "segment_len": a.segment_len}
    caps, secs = [], []
    for i, d in enumerate(docs):
        t0 = time.perf_counter()
        caps.append(capture_document(lm, d, a.segment_len, name=f"heldout-{i}"))
        secs.append(time.perf_counter() - t0)
    out["capture_seconds"] = [round(s, 2) for s in secs]
    table = summary.document_set_table(caps)
    out["overview"] = summary.overview(table, a.segment_len)
    cols = ["layer", "head", "erank", "numerical_rank", "stable_rank", "horizon", "mean_key_norm", "key_cov_erank",
            "decayed_P_erank"]
    out["heads"] = json.loads(table[[c for c in cols if c in table.columns]].to_json(orient="records"))
    log(f"capture of a {L}-token document: {np.median(secs):.2f}s (median of {len(secs)}); "
        f"overview {json.dumps(out['overview'])}")
    rows = run_loss_sweep(lm, [(f"heldout-{i}", d) for i, d in enumerate(docs)],
                          LossSweepSpec(ranks=tuple(a.seed000_ranks), segment_len=a.segment_len))
    df = loss_table(rows)
    df = df[df["subset"] == "all"][["r", "loss", "delta", "se", "n_docs"]]
    out["loss_vs_rank"] = json.loads(df.to_json(orient="records"))
    log("loss vs rank:\n" + df.to_string(index=False))
    trunc = {}
    for r in a.seed000_ranks:
        spec = TruncationSpec.all_heads(lm.info, r)
        sc, _ = ruler_cells(lm, a.seed000_tasks, [max(a.lens)], a.seed000_n, a.seed0, a.segment_len, spec, log)
        trunc[str(r)] = sc
    out["ruler_truncated"] = trunc
    return out


def verdict(task: str, cells: dict, lens) -> str:
    """'pass' / 'FAIL' against ``BAR`` (every length at or above the bar), 'reported' for unbarred tasks."""
    if task not in BAR:
        return "reported"
    ok = all(cells.get(str(L), float("nan")) >= BAR[task] for L in lens)
    return "pass" if ok else "FAIL"


def markdown(res: dict) -> str:
    lens = res["lens"]
    lines = [f"RULER (ruler.py prompts, held-out seeds {res['seed0']}+, n = {res['n']} per cell, greedy, "
             f"string_match_all x100; bar: issue 33's, at every length):", "",
             "| task | " + " | ".join(f"{L // 1024}K" if L % 1024 == 0 else str(L) for L in lens)
             + " | bar | verdict |",
             "|---|" + "---|" * len(lens) + "---|---|"]
    for task, cells in res["ruler"].items():
        bar = f"≥ {BAR[task]:g}" if task in BAR else "—"
        lines.append(f"| {task} | " + " | ".join(f"{cells.get(str(L), float('nan')):.1f}" for L in lens)
                     + f" | {bar} | {verdict(task, cells, lens)} |")
    if res.get("ruler_no_attention"):
        lines += ["", "The same cells with every full-attention layer's output zeroed (what the GDN heads answer "
                      "alone):", "",
                  "| task | " + " | ".join(f"{L // 1024}K" if L % 1024 == 0 else str(L) for L in lens) + " |",
                  "|---|" + "---|" * len(lens)]
        for task, cells in res["ruler_no_attention"].items():
            lines.append(f"| {task} | " + " | ".join(f"{cells.get(str(L), float('nan')):.1f}" for L in lens)
                         + " |")
    if res.get("heldout"):
        h = res["heldout"]
        lines += ["", f"Held-out perplexity: {h['ppl']:.2f} per token ({h['bits_per_byte']:.3f} bits/byte) on "
                      f"{h['tokens']:,} held-out tokens (windows of {h['window']})."]
    s = res.get("seed000")
    if s:
        o = s["overview"]
        lines += ["", f"Seed 000 measurements ({s['docs']} held-out documents of {s['doc_tokens']} tokens, "
                      f"segments of {s['segment_len']}):", "",
                  f"- effective rank at the document end: median {o['erank_median']:.1f}, q25 {o['erank_q25']:.1f}, "
                  f"max {o['erank_max']:.1f} over {o['n_heads']} GDN heads; numerical rank median "
                  f"{o['numerical_rank_median']:.0f}",
                  f"- Spearman rho(erank, horizon) = {o['spearman_erank_horizon']:.2f}"
                  + (f" (95% bootstrap CI over heads {o['spearman_ci95'][0]:.2f}-{o['spearman_ci95'][1]:.2f})"
                     if o.get("spearman_ci95") else "")
                  + f"; share of heads forgetting within a segment: "
                  f"{100 * o['share_forgetting_within_segment']:.0f}%",
                  f"- capture of one {s['doc_tokens']}-token document: {min(s['capture_seconds']):.2f}-"
                  f"{max(s['capture_seconds']):.2f} s on {res['device']}", "",
                  "| r (all GDN heads) | loss | delta | paired SE | " + " | ".join(
                      f"{t}@{max(lens)}" for t in next(iter(s["ruler_truncated"].values()), {})) + " |",
                  "|---|---|---|---|" + "---|" * len(next(iter(s["ruler_truncated"].values()), {}))]
        for row in s["loss_vs_rank"]:
            r = str(int(row["r"]))
            cells = s["ruler_truncated"].get(r)
            if cells is None and int(row["r"]) == 128:
                cells = {t: res["ruler"].get(t, {}).get(str(max(lens)), float("nan"))
                         for t in next(iter(s["ruler_truncated"].values()), {})}
            cells = cells or {}
            lines.append(f"| {r} | {row['loss']:.4f} | {row['delta']:+.4f} | {row.get('se', float('nan')):.4f} | "
                         + " | ".join(f"{v[str(max(lens))]:.1f}" if isinstance(v, dict) else f"{v:.1f}"
                                      for v in cells.values()) + " |")
        lines += ["", f"Per head (median over the {s['docs']} documents; effective rank at the document end; "
                      "horizon = 1/(1 − mean α) in tokens):", "",
                  "| layer:head | erank | numerical rank | horizon | mean key norm | key-cov erank |",
                  "|---|---:|---:|---:|---:|---:|"]
        for h in s["heads"]:
            lines.append(f"| {h['layer']}:{h['head']} | {h['erank']:.1f} | {h['numerical_rank']:g} | "
                         f"{h['horizon']:.1f} | {h['mean_key_norm']:.2f} | {h['key_cov_erank']:.1f} |")
    return "\n".join(lines) + "\n"


def card_split(card: Path) -> tuple[str, str]:
    """``card``'s text up to and including the ``CARD_BEGIN`` line, and from the ``CARD_END`` line on.
    ValueError naming the file when a marker is missing or they are out of order."""
    text = card.read_text()
    i, j = text.find(CARD_BEGIN), text.find(CARD_END)
    if i < 0 or j < i:
        raise ValueError(f"{card}: needs the marker lines {CARD_BEGIN!r} then {CARD_END!r}")
    return text[:i + len(CARD_BEGIN)], text[j:]


def write_outputs(a, res: dict, rows: list | None) -> str:
    """Writes the evaluation with its samples to --out-json (not when it was read with --card-from), the markdown
    block to --out-md (if given) and between the card's markers (if --card); returns the block."""
    md = markdown(res)
    if rows is not None:
        Path(a.out_json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out_json).write_text(json.dumps({**res, "samples": rows}, indent=1))
    if a.out_md:
        Path(a.out_md).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out_md).write_text(md)
    if a.card:
        head, tail = card_split(Path(a.card))
        Path(a.card).write_text(head + "\n\n" + md + "\n" + tail)
    return md


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.card:
        try:
            card_split(Path(a.card))  # before any measuring: a bad card must not cost an evaluation
        except (OSError, ValueError) as e:
            raise SystemExit(f"--card: {e}")
    if a.card_from:
        try:
            res = json.loads(Path(a.card_from).read_text())
        except (OSError, ValueError) as e:
            raise SystemExit(f"--card-from {a.card_from}: not a readable evaluation JSON ({e})")
        res.pop("samples", None)
        print(write_outputs(a, res, None))
        return 0
    a.out_md = a.out_md or "out/demo/eval/eval.md"
    if a.pylib:
        sys.path.insert(0, str(Path(a.pylib).resolve()))
    sys.path.insert(0, str(ROOT))
    import torch

    from gdnviz.models import load

    t_all = time.time()
    log = lambda m: print(m, flush=True)  # noqa: E731
    lm = load(a.model, device=a.device, dtype=a.dtype)
    lm.model.eval()
    dev = str(lm.device)
    threads = torch.get_num_threads()
    log(f"model {a.model}: {sum(p.numel() for p in lm.model.parameters()):,} params on {dev} "
        f"({threads} threads), tokenizer vocab {len(lm.tokenizer)}")
    res: dict = {"model": str(a.model), "device": f"{dev} ({threads} threads)" if dev == "cpu" else dev,
                 "n": a.n, "seed0": a.seed0, "lens": a.lens, "tasks": a.tasks,
                 "versions": {"torch": torch.__version__, "transformers": __import__("transformers").__version__}}
    if a.heldout and Path(a.heldout).exists():
        held, n_bytes = heldout_stream(lm.tokenizer, Path(a.heldout))
        res["heldout"] = perplexity(lm, held, n_bytes, a.ppl_window, a.ppl_max_windows)
        log(f"held-out: {json.dumps(res['heldout'])}")
    else:
        held = []
        log(f"no held-out text at {a.heldout}: perplexity skipped")
    res["ruler"], rows = ruler_cells(lm, a.tasks, a.lens, a.n, a.seed0, a.segment_len, log=log)
    if a.no_attention:
        with AttentionZeroed(lm.model):
            res["ruler_no_attention"], rows_na = ruler_cells(lm, a.tasks, a.lens, a.n, a.seed0, a.segment_len,
                                                             log=lambda m: log(m + "  [attention zeroed]"))
        rows += [dict(r, attention="zeroed") for r in rows_na]
    if a.seed000:
        if len(held) < a.seed000_len:
            log("seed 000 measurements need held-out text: skipped")
        else:
            res["seed000"] = seed000(lm, held, a, log)
    res["seconds"] = round(time.time() - t_all, 1)
    print(write_outputs(a, res, rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
