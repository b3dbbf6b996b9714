"""Whether the decode step of the MoE families (Qwen3.5-MoE, Qwen3-Next) captures into a CUDA graph, per dtype and
experts implementation (``gdnviz.static_decode``). Rerun it after a transformers upgrade: on transformers 5.17 (H200,
2026-12-01) bf16 captured with every implementation but ``eager``, float32 only with ``batched_mm``.

    python bench/studies/study_moe_capture.py [--device cpu]   # one JSON line per (family, dtype, experts)

Tiny random models (tests/tiny_models.py), a batch of 3 left-padded prompts, 12 decode steps, no truncation. Each
line: the experts implementation the model resolved to, how many steps replayed, the decoder's reason (None =
captured), and whether the replayed logits equal the eager static steps' bit for bit.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

STEPS = 12


def _run(lm, prompts, graph: bool):
    import torch

    from gdnviz import static_decode
    from gdnviz.probes.batch import batched_forward

    out, ctx, mask, _ = batched_forward(lm, prompts, segment_len=16, use_cache=True, logits_positions="last",
                                        keep_hidden=False)
    dec = static_decode.StaticDecoder(lm, ctx, out.cache, STEPS, attention_mask=mask, positions=mask.sum(-1),
                                      graph=graph)
    nxt, logits = out.logits[:, -1].argmax(-1), []
    for i in range(STEPS):
        logits.append(dec.step(nxt).float())
        nxt = logits[-1].argmax(-1)
    return torch.stack(logits), dec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda", help="cuda (the study) or cpu (a smoke run: eager steps only)")
    device = ap.parse_args().device

    import tiny_models
    import torch

    from gdnviz import static_decode
    from gdnviz.models import from_model

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 97, (n,), generator=g).tolist() for n in (37, 20, 9)]
    for family in ("qwen3_5_moe", "qwen3_next"):
        for dtype in (torch.float32, torch.bfloat16):
            for experts in (None, "eager", "grouped_mm", "batched_mm"):
                static_decode._FAILED.clear()
                model = getattr(tiny_models, family)().to(device, dtype)
                row = {"family": family, "dtype": str(dtype).replace("torch.", ""), "asked": experts}
                try:
                    if experts is not None:
                        model.set_experts_implementation(experts)
                    row["experts"] = model.config._experts_implementation
                    lm = from_model(model, family)
                    eager, _ = _run(lm, prompts, False)
                    graphed, dec = _run(lm, prompts, device == "cuda")
                    row.update(replays=dec.replays, reason=dec.reason,
                               bits_equal=bool(torch.equal(graphed, eager)),
                               max_abs=float((graphed - eager).abs().max()))
                except Exception as e:  # a study: report and go on
                    row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
