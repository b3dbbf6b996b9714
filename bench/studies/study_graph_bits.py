"""Which operation of a bfloat16 decode step gives other bits when replayed from a CUDA graph than when run eagerly?

gdnviz's ``StaticDecoder`` replays equal its eager steps bit for bit on float32 tiny models
(tests/test_static_decode.py), but on the 0.8B shape in bfloat16 the replayed logits differed from the eager static
step's by up to 0.047 (``bench_decode.py``). This study runs each candidate operation at the decode step's shapes
eagerly and from a graph and prints whether the bits agree, then the first decoder layer whose output differs in a
whole step (the same step, eager vs captured, from the same cache contents).

    PYTHONPATH=$PWD python3 bench/studies/study_graph_bits.py            # ops and the layers of one step
    PYTHONPATH=$PWD python3 bench/studies/study_graph_bits.py --steps    # 24 steps, eager twice and graph, batch 1 and 4
"""
from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from bench.common import emit, qwen35_08b_config, random_model  # noqa: E402


def graph_vs_eager(name: str, fn, *args) -> None:
    """Run ``fn(*args)`` eagerly and replayed from a graph (after a side-stream warm-up); print whether equal."""
    eager = fn(*args).clone()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn(*args)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fn(*args)
    g.replay()
    torch.cuda.synchronize()
    d = (out.float() - eager.float()).abs().max().item()
    emit(what="op", op=name, equal=bool(torch.equal(out, eager)), max_abs_diff=d)


def ops(dev) -> None:
    torch.manual_seed(0)
    bf = torch.bfloat16
    for B in (1, 4):
        x = torch.randn(B, 1, 1024, device=dev, dtype=bf)
        for n in (3584, 6144, 248320):
            w = torch.randn(n, 1024, device=dev, dtype=bf) * 0.02
            graph_vs_eager(f"linear B={B} 1024->{n}", F.linear, x, w)
        M = 4096 + 64
        q = torch.randn(B, 8, 1, 256, device=dev, dtype=bf)
        k = torch.randn(B, 8, M, 256, device=dev, dtype=bf)
        v = torch.randn(B, 8, M, 256, device=dev, dtype=bf)
        mask = torch.zeros(B, 1, 1, M, device=dev, dtype=bf)
        mask[..., 4100:] = torch.finfo(bf).min
        graph_vs_eager(f"sdpa B={B} M={M} float mask", lambda a, b, c, m: F.scaled_dot_product_attention(
            a, b, c, attn_mask=m), q, k, v, mask)
        from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule

        H = 16
        qq = F.normalize(torch.randn(B, 1, H, 128, device=dev), dim=-1).to(bf)
        kk = F.normalize(torch.randn(B, 1, H, 128, device=dev), dim=-1).to(bf)
        vv = torch.randn(B, 1, H, 128, device=dev, dtype=bf)
        gg = -torch.rand(B, 1, H, device=dev)
        bb = torch.rand(B, 1, H, device=dev, dtype=bf)
        h0 = torch.randn(B, H, 128, 128, device=dev)
        graph_vs_eager(f"fla fused_recurrent B={B}", lambda *a: fused_recurrent_gated_delta_rule(
            *a[:3], g=a[3], beta=a[4], initial_state=a[5], output_final_state=True,
            use_qk_l2norm_in_kernel=False)[0], qq, kk, vv, gg, bb, h0)


def _model_and_prompt(dev, batch: int):
    """The 0.8B shape with random bf16 weights behind gdnviz's adapter, and ``batch`` random 4K-token prompts."""
    from gdnviz.models import from_model

    model = random_model(qwen35_08b_config(), dev, torch.bfloat16)
    ids = torch.randint(10, model.config.vocab_size, (batch, 4096), generator=torch.Generator().manual_seed(0))
    return from_model(model, "graph-bits"), ids.to(dev)


def layers(dev) -> None:
    """One decode step of gdnviz's StaticDecoder, eager vs captured, with every decoder layer's output kept."""
    from gdnviz import runner
    from gdnviz.static_decode import StaticDecoder

    lm, ids = _model_and_prompt(dev, 1)
    model = lm.model
    seen: list = []
    hooks = [layer.register_forward_hook(lambda m, a, o: seen.append(o[0] if isinstance(o, tuple) else o))
             for layer in model.model.layers]
    res = {}
    for graph in (False, True):
        ctx = runner.RunContext(segment_len=runner.DEFAULT_SEGMENT_LEN)
        out = runner.forward(lm, ids, use_cache=True, logits_positions="last", keep_hidden=False, ctx=ctx)
        dec = StaticDecoder(lm, ctx, out.cache, 3, graph=graph)
        dec.step([5])  # step 0: eager in both (the warm-up)
        seen.clear()
        logits = dec.step([7])  # step 1: captured and replayed, or eager
        torch.cuda.synchronize()
        res[graph] = (logits, [t.clone() for t in seen], dec.replays)
    for h in hooks:
        h.remove()
    (le, se, _), (lg, sg, rep) = res[False], res[True]
    first = next((i for i, (a, b) in enumerate(zip(se, sg)) if not torch.equal(a, b)), None)
    emit(what="step", replays=rep, logits_equal=bool(torch.equal(le, lg)),
         max_abs_logit_diff=(le - lg).abs().max().item(), first_layer_differing=first,
         layer_types=[model.config.layer_types[i] for i in range(min(len(se), 6))],
         per_layer_max_diff=[round((a.float() - b.float()).abs().max().item(), 5) for a, b in zip(se, sg)])


def steps(dev, n: int = 24, batch: int = 1) -> None:
    """``n`` decode steps of gdnviz's StaticDecoder, eager vs graph, fed the same tokens: per step whether the
    logits agree (the first steps' agreement does not rule out a later difference)."""
    from gdnviz import runner
    from gdnviz.static_decode import StaticDecoder

    lm, ids = _model_and_prompt(dev, batch)
    feed = torch.randint(10, 1000, (n, batch), generator=torch.Generator().manual_seed(1)).to(dev)
    res = {}
    for graph in (False, True, False):
        ctx = runner.RunContext(segment_len=runner.DEFAULT_SEGMENT_LEN)
        out = runner.forward(lm, ids, use_cache=True, logits_positions="last", keep_hidden=False, ctx=ctx)
        mask = torch.ones(ids.shape, dtype=torch.long)
        dec = StaticDecoder(lm, ctx, out.cache, n, attention_mask=mask, graph=graph)
        logits = torch.stack([dec.step(feed[i]) for i in range(n)])
        torch.cuda.synchronize()
        res.setdefault(graph, []).append(logits)
    e1, e2, g = res[False][0], res[False][1], res[True][0]
    emit(what="steps", batch=batch, n=n, eager_runs_equal=bool(torch.equal(e1, e2)),
         graph_equal_per_step=[bool(torch.equal(a, b)) for a, b in zip(g, e1)],
         max_abs_diff_per_step=[round((a - b).abs().max().item(), 4) for a, b in zip(g, e1)],
         eager_rerun_max_abs_diff_per_step=[round((a - b).abs().max().item(), 4) for a, b in zip(e2, e1)])


if __name__ == "__main__":
    dev = torch.device("cuda")
    if "--steps" in sys.argv:
        for b in (1, 4):
            steps(dev, batch=b)
    else:
        ops(dev)
        layers(dev)
