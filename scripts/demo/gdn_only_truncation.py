"""Issue 33's "retrieval carried by the GDN states", measured the way it can be on a model whose attention layers
also retrieve: with every full-attention layer's output zeroed (the GDN heads answer alone), is a RULER cell still
answered untouched, and does cutting every GDN head to rank r at every boundary break it?

    python scripts/demo/gdn_only_truncation.py --model out/demo/v3b --tasks niah_single_1,vt --len 4096 --n 20 \
        --ranks 1,4 --out-json out/demo/eval/v3b.gdn_only.json

Same prompts (held-out seeds 1,000,000+), scorer and greedy decoding as evaluate.py; prints a markdown table and
writes the scores (and every answer) as JSON.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--tasks", default="niah_single_1,vt")
    ap.add_argument("--len", type=int, default=4096)
    ap.add_argument("--n", type=int, default=20)
    ap.add_argument("--ranks", default="1,4")
    ap.add_argument("--seed0", type=int, default=1_000_000)
    ap.add_argument("--segment-len", type=int, default=256)
    ap.add_argument("--out-json", required=True)
    a = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import torch

    from evaluate import AttentionZeroed, ruler_cells
    from gdnviz.models import load
    from gdnviz.truncation import TruncationSpec

    lm = load(a.model, device="cpu", dtype="float32")
    lm.model.eval()
    tasks = a.tasks.split(",")
    ranks = [int(r) for r in a.ranks.split(",")]
    log = lambda m: print(m, flush=True)  # noqa: E731
    t0 = time.time()
    out = {"model": a.model, "len": a.len, "n": a.n, "seed0": a.seed0, "segment_len": a.segment_len,
           "threads": torch.get_num_threads(), "scores": {}, "rows": []}
    with AttentionZeroed(lm.model):
        for r in [None] + ranks:
            spec = None if r is None else TruncationSpec.all_heads(lm.info, r)
            sc, rows = ruler_cells(lm, tasks, [a.len], a.n, a.seed0, a.segment_len, spec, log)
            key = "untouched" if r is None else str(r)
            out["scores"][key] = {t: sc[t][str(a.len)] for t in tasks}
            out["rows"] += [dict(row, r=key) for row in rows]
    out["seconds"] = round(time.time() - t0, 1)
    Path(a.out_json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out_json).write_text(json.dumps(out, indent=1))
    print(f"\nAttention zeroed, {a.len} tokens, n = {a.n}, every GDN head cut to r at every boundary:\n")
    print("| r | " + " | ".join(tasks) + " |\n|---|" + "---|" * len(tasks))
    for key, sc in out["scores"].items():
        print(f"| {key} | " + " | ".join(f"{sc[t]:.1f}" for t in tasks) + " |")
    print(f"\n{out['seconds']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
