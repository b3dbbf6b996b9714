"""Whether the decode step of the MoE families (Qwen3.5-MoE, Qwen3-Next) captures into a CUDA graph, per dtype and
experts implementation (``gdnviz.static_decode``; sixteenth session: the float32 tiny models fell back to eager
static steps with "Cannot copy between CPU and CUDA tensors during CUDA graph capture").

    python3 bench/study_moe_capture.py [--device cpu]   # one JSON line per (family, dtype, experts implementation)

Tiny random models (tests/tiny_models.py), a batch of 3 left-padded prompts, 12 decode steps, no truncation. Each
line: the experts implementation the model resolved to, how many steps replayed, the decoder's reason (None =
captured), and whether the replayed logits equal the eager static steps' bit for bit.
"""
from __future__ import annotations

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))

import torch  # noqa: E402

import tiny_models  # noqa: E402
from gdnviz import static_decode  # noqa: E402
from gdnviz.models import from_model  # noqa: E402
from gdnviz.probes.batch import batched_forward  # noqa: E402

STEPS = 12


def _run(lm, prompts, graph: bool):
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
    device = sys.argv[sys.argv.index("--device") + 1] if "--device" in sys.argv else "cuda"  # cpu: a smoke run
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
