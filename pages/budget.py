"""Cache budget (seed 003 §7): recurrent-state bytes vs full-attention KV bytes against context length."""
from __future__ import annotations

import numpy as np
import pandas as pd
import streamlit as st

from gdnviz import figures as F
from gdnviz.plotstyle import human_bytes
from gdnviz.ui import common as C

C.ensure_entrypoint()

st.title("Cache budget")
st.caption("What one sequence costs in cache memory for the loaded configuration (seed 003 §7). Configuration "
           "arithmetic, not a measurement of device memory; weights and activations are not included.")
info = C.inspected()
src = "the inspected model"
if info is None:
    run = C.current_run()
    if run is not None:
        info, src = run["model"], f"the model of run `{run['run_id']}`"
if info is None:
    C.empty_state("No model yet.", "Pick a model on the **Model & documents** page (it is inspected without "
                                   "loading its weights); its configuration fills this page.")
    st.stop()

BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8": 1}
st.session_state.setdefault("bud_batch", 1)
st.session_state.setdefault("bud_state_dtype", "float32")
st.session_state.setdefault("bud_kv_dtype", "bfloat16")
st.session_state.setdefault("bud_max_ctx", 1 << 20)
c = st.columns(4)
c[0].number_input("Batch B (sequences)", min_value=1, max_value=1 << 16, key="bud_batch")
c[1].selectbox("Recurrent-state dtype (b_state)", list(BYTES), key="bud_state_dtype",
               help="GDN kernels keep the state in float32")
c[2].selectbox("KV and conv dtype (b_KV)", list(BYTES), key="bud_kv_dtype")
c[3].select_slider("Longest context T", options=[1 << k for k in range(10, 24)], key="bud_max_ctx",
                   format_func=lambda t: f"{t // 1024:,}K" if t < 1 << 20 else f"{t // (1 << 20)}M")

fp = info.get("fingerprint", "x")
st.markdown(f"Configuration from {src} (**{info.get('name') or info.get('path')}**). Edit to explore:")
FIELDS = (  # (cache_budget_frame's argument, label, key, the model's value, help)
    ("n_gdn", "|GDN layers|", "ngdn", len(info["gdn_layers"]), None),
    ("h_v", "H_v", "hv", int(info["num_heads"]), "value heads per GDN layer (one state each)"),
    ("h_k", "H_k", "hk", int(info["num_key_heads"]), None),
    ("d_k", "d_k", "dk", int(info["d_k"]), None),
    ("d_v", "d_v", "dv", int(info["d_v"]), None),
    ("n_attn", "|attn layers|", "nattn", len(info["attn_layers"]), None),
    ("h_kv", "H_kv", "hkv", int(info["attn_kv_heads"]), None),
    ("d_h", "d_h", "dh", int(info["attn_head_dim"]), None),
)
cfg = {}
for col, (arg, label, k, v, help_) in zip(st.columns(len(FIELDS)), FIELDS):
    key = f"bud_{k}_{fp}"  # per model (common.PERSISTED_MODEL_KEY): another model starts from its own values
    st.session_state.setdefault(key, v)
    cfg[arg] = col.number_input(label, min_value=0, key=key, help=help_)
cfg["conv_kernel"] = int(info.get("conv_kernel", 4))
B = int(st.session_state["bud_batch"])
bs, bk = BYTES[st.session_state["bud_state_dtype"]], BYTES[st.session_state["bud_kv_dtype"]]
Tmax = int(st.session_state["bud_max_ctx"])
ctx = sorted({int(t) for t in np.unique(np.logspace(8, np.log2(Tmax), num=24, base=2).round())})
kw = dict(cfg, batch=B, b_state=bs, b_kv=bk, b_conv=bk)
df = F.cache_budget_frame(contexts=ctx, **kw)
cross = F.crossover_context(**kw)

st.latex(r"\text{recurrent} = B\,|\mathcal R|\,H_v\,d_k\,d_v\,b_{\text{state}}\quad(\text{constant in }T)"
         r"\qquad \text{KV} = B\,|\mathcal A|\cdot 2\,H_{KV}\,d_h\,T\,b_{KV}")
rec = df[df.cache == "GDN recurrent state"]["bytes"].iloc[0]
conv = df[df.cache == "GDN conv window"]["bytes"].iloc[0]
per_tok = B * cfg["n_attn"] * 2 * cfg["h_kv"] * cfg["d_h"] * bk
m = st.columns(4)
m[0].metric("Recurrent state", human_bytes(rec), help="all GDN layers, every T")
m[1].metric("KV per token", human_bytes(per_tok), help="all full-attention layers")
m[2].metric("KV = recurrent at", "never" if not np.isfinite(cross) else f"T ≈ {cross:,.0f}")
m[3].metric("Conv windows (separate)", human_bytes(conv),
            help=f"B·|GDN|·(2·H_k·d_k + H_v·d_v)·{cfg['conv_kernel']}·b (the short-convolution cache, constant in T)")
C.chart(F.cache_budget_chart(df, cross), df, "cache_budget", key="bud_chart")
pts = [t for t in (4096, 32768, 131072, 1 << 20) if t <= Tmax] or [Tmax]
tab = F.cache_budget_frame(contexts=pts, **kw).pivot(index="context", columns="cache", values="bytes")
tab = tab.map(human_bytes).reset_index()
tab["context"] = [f"{int(t):,}" for t in tab["context"]]
st.dataframe(tab.rename(columns={"context": "T (tokens)"}), hide_index=True, width="stretch")
