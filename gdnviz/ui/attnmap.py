"""The Head page's "Exact attention map" section: the open GDN head's exact map w_{t,s} over a window of query
positions of a run's document, next to a full-attention layer's softmax weights at the same positions
(docs/attribution.md). Computed by an AttnMapJob in the worker and read back from the memo under its two keys
(``gdnviz.jobs.attnmap_keys``: the run's capture key of the document, the head, the window, the attention layer
and head), so a result is shown only for exactly the request on the page.
"""
from __future__ import annotations

import json
from pathlib import Path

import streamlit as st

from gdnviz.ui import common as C

TITLE = "Exact attention map"
SHOWN = ("key", "tokens_back", "context", "weight", "share")  # the top-key table's columns on the page
DEFAULT_WINDOW = 256
MEAN = "mean over heads"
NONE = "none (GDN map only)"


def default_window(T: int, L: int) -> tuple[int, int]:
    """The last DEFAULT_WINDOW query positions before the last segment boundary (the document end when T < L)."""
    end = (T // L) * L if T >= L else T
    return max(0, end - DEFAULT_WINDOW), end


@st.cache_data(show_spinner=False)
def attention_heads(config_path: str) -> int | None:
    """Query heads of the model's full-attention layers, from its config.json (None when unreadable)."""
    try:
        c = json.loads(Path(config_path).read_text())
        return int(c.get("text_config", c)["num_attention_heads"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def request(run: dict, doc: str, layer: int, head: int, start: int, end: int, attn_layer,
            attn_head) -> tuple[dict, tuple]:
    """(the AttnMapJob as the queue's dict, its two memo keys) for document ``doc`` of ``run``."""
    from gdnviz.jobs import AttnMapJob, attnmap_keys, spec_to_dict

    names = [d["name"] for d in run["documents"]]
    d = run["documents"][names.index(doc)]
    text = dict((n, t) for n, t in run["spec"]["documents"])[doc]
    spec = AttnMapJob(model=run["model_name"], document=(doc, text), doc_key=d["key"], layer=int(layer),
                      head=int(head), start=int(start), end=int(end), attn_layer=attn_layer, attn_head=attn_head,
                      segment_len=int(run["segment_len"]), device=run["spec"].get("device", "auto"),
                      dtype=run["spec"].get("dtype", "auto"),
                      trust_remote_code=run["spec"].get("trust_remote_code") is True)
    return spec_to_dict(spec), attnmap_keys(d["key"], layer, head, start, end, attn_layer, attn_head)


@st.cache_data(show_spinner=False, max_entries=4)  # a stored map is up to 256 MiB
def _map(cache_dir: str, key: str):
    """(w, meta) stored under ``key``; KeyError when absent or corrupt (nothing is cached then)."""
    from gdnviz.jobs import unpack_map

    data = C._store(cache_dir).memo_get(key)
    if data is None:
        raise KeyError(key)
    return unpack_map(data)


@st.cache_data(show_spinner=False, max_entries=16)
def figure(cache_dir: str, key: str, kind: str, title: str, subtitle: tuple, keys: tuple | None = None,
           interactive: bool = True) -> dict:
    """The spec of one stored map (a pure function of its memo key), over key positions ``keys`` (k0, k1) or all;
    ``interactive`` False: the export's (no click, no query rule), built when a download is clicked."""
    from gdnviz.ui import attnmap_charts as AC
    from gdnviz.ui import specs

    w, meta = _map(cache_dir, key)
    with specs.fast_build():
        return specs.spec(AC.heatmap(w, meta["start"], kind, title, list(subtitle), interactive=interactive,
                                     keys=keys))


def csv_bytes(cache_dir: str, key: str) -> bytes:
    """The stored map under ``key`` as long-form CSV (``query, key, weight``, every ``s ≤ t``), built when its
    download button is clicked (the largest stored maps give millions of rows)."""
    from gdnviz.figures import to_csv
    from gdnviz.ui import attnmap_charts as AC

    w, meta = _map(cache_dir, key)
    return to_csv(AC.long_frame(w, meta["start"]))


def _map_chart(args: tuple, t: int, cache: str, key: str, name: str, chart_key: str) -> None:
    """The heatmap ``figure(*args)`` with the picked query marked, its PNG / SVG downloads (the export figure, built
    on click), and its CSV (made on click)."""
    from gdnviz.ui import attnmap_charts as AC

    C.chart(AC.with_query(figure(*args), t), None, name, key=chart_key, on_select="rerun", selection_mode="row",
            export=lambda: figure(*args, interactive=False))
    st.download_button("CSV of the whole map (query, key, weight)", data=lambda: csv_bytes(cache, key),
                       file_name=f"{name}.csv", mime="text/csv", on_click="ignore", key=f"{chart_key}_csv",
                       icon=":material/table:")


def _stored(key: str | None):
    if key is None:
        return None
    s = C.store()
    if not s.memo_has(key):
        return None
    try:
        return _map(str(s.dir), key)
    except KeyError:  # failed its checksum between the two reads: compute again
        return None


def section(run: dict, layer: int, head: int, default_doc: str) -> None:
    """Draw the section for GDN ``(layer, head)`` of ``run``: the request widgets, the Compute state or the maps."""
    from gdnviz.jobs import MAX_STORED_MAP_BYTES

    model = run["model"]
    L = int(run["segment_len"])
    names = [d["name"] for d in run["documents"]]
    st.markdown(f"#### {TITLE}")
    st.caption("Exact: the head's output at query t is o_t = Σ_s w_t,s v_s with w_t,s = β_s q_tᵀ A_t⋯A_s+1 k_s, "
               "A = α(I − β k kᵀ) — every later token's decay and delta-rule removal included (float64, from the "
               "model's own q, k, v, g, β). Signed and unnormalised, unlike softmax attention. Beside it, for "
               "comparison, the softmax weights of a full-attention layer at the same positions. "
               "Definitions: docs/attribution.md.")
    if st.session_state.get("am_doc") not in names:
        st.session_state["am_doc"] = default_doc
    attn_layers = list(model.get("attn_layers") or [])
    c = st.columns([2, 1, 1, 1, 1])
    doc = c[0].selectbox("Document", names, key="am_doc")
    T = int(run["documents"][names.index(doc)]["n_tokens"])
    s0, e0 = default_window(T, L)
    if st.session_state.get("am_for") != (doc, T):  # a new document: its default window
        st.session_state.update(am_for=(doc, T), am_start=s0, am_end=e0)
    cap = MAX_STORED_MAP_BYTES // 2**20
    start = c[1].number_input("First query position", min_value=0, step=64, key="am_start",
                              help=f"0-based token index; the window is start..end−1 (default: the last "
                                   f"{DEFAULT_WINDOW} before the last boundary, {s0:,}..{e0 - 1:,})")
    end = c[2].number_input("End (exclusive)", min_value=1, step=64, key="am_end",
                            help=f"keys are 0..end−1; at most {T:,} (the document). Limit: one map is float64 "
                                 f"[end − start, end], at most {cap} MiB (e.g. 2,048 queries over 16,384 keys)")
    if attn_layers:
        al = c[3].selectbox("Softmax layer", attn_layers + [NONE], key="am_attn_layer",
                            help="a full-attention layer of the same model (its own index) for comparison, or none")
    if attn_layers and al != NONE:
        n_ah = attention_heads(str(Path(model.get("path") or "") / "config.json"))
        opts = [MEAN] + (list(range(n_ah)) if n_ah else [])
        ah = c[4].selectbox("Softmax head", opts, key="am_attn_head",
                            format_func=lambda h: h if h == MEAN else f"head {h}",
                            help="a query head of that layer, or the mean of the weights over its query heads")
        ah = None if ah == MEAN else int(ah)
    else:
        al = ah = None
        if not attn_layers:
            st.caption("This model has no full-attention layer, so there is no softmax attention to compare with: "
                       "only the GDN map is shown.")
    spec, (gkey, skey) = request(run, doc, layer, head, int(start), int(end), al, ah)
    what = f"layer {layer} head {head}, “{doc}”, queries {int(start):,}..{int(end) - 1:,}"
    if al is not None:
        what += f", softmax of layer {al} ({'mean over heads' if ah is None else f'head {ah}'})"
    gdn, soft = _stored(gkey), _stored(skey)
    if gdn is None or (skey is not None and soft is None):
        jobs = st.session_state.setdefault("am_jobs", {})
        st.session_state["am_job_now"] = jobs.get((gkey, skey))
        rec = C.job_panel("am_job_now", TITLE)
        busy = rec is not None and rec["status"] in ("queued", "running")
        if not busy:
            qk = " and the attention layer's queries and keys" if al is not None else ""
            st.info(f"**Not computed yet** for {what}. **Compute** runs the model over the first {int(end):,} tokens "
                    f"in the worker for this head's inputs{qk}, then the exact map (float64; seconds for a few "
                    "hundred queries over a few thousand keys).", icon=":material/info:")
        if st.button("Compute", key="am_compute", type="primary", icon=":material/play_arrow:", disabled=busy):
            jobs[(gkey, skey)] = C.submit("attnmap", spec, label=f"{TITLE}: L{layer}·H{head} "
                                                                 f"{int(start):,}..{int(end) - 1:,}")
            st.rerun()
        return
    draw(gdn, soft, gkey, skey)


def draw(gdn, soft, gkey: str, skey: str | None) -> None:
    """The two heatmaps side by side, the query row picker (a click on a map sets it) and its top keys."""
    from gdnviz.ui import attnmap_charts as AC

    w, meta = gdn
    start, end, tokens = int(meta["start"]), int(meta["end"]), meta["tokens"]
    cache = str(C.store().dir)
    tag = f"L{meta['layer']}H{meta['head']}_q{start}-{end - 1}"
    st.caption(f"“{meta['document']}” · queries {start:,}..{end - 1:,} over keys 0..{end - 1:,} of {meta['T']:,} "
               "tokens "
               f"· {meta['dtype']} run on {meta['device']}, map {meta['map_dtype']} on {meta['map_device']} · check: "
               f"Σ_s w_t,s v_s reproduces the head's float64 output to {meta['output_check']:.1e} (relative)")
    sub_g = ["w_t,s = β_s q_tᵀ A_t⋯A_s+1 k_s: signed, unnormalised",
             "red > 0, blue < 0 (symmetric log colour); blank: s > t"]
    # a new result starts at its last query (am_row is kept across page switches: common.PERSISTED)
    if st.session_state.get("am_row_for") != gkey or "am_row" not in st.session_state:
        st.session_state.update(am_row_for=gkey, am_row=end - 1)
    picked = None  # a query picked by a new click on either map (each map's selection persists across reruns)
    for which in ("gdn", "soft"):
        picked = _new_click(which, st.session_state.get(f"ch_am_{which}"), picked)
    if picked is not None and start <= picked < end:
        st.session_state["am_row"] = int(picked)
    t = int(st.session_state["am_row"])
    keys = None
    if end > AC.MAX_COLS:  # a zoom on the key axis: the blocks drawn cover the chosen range only
        # a new result: all keys
        if st.session_state.get("am_keys_for") != gkey or "am_keys" not in st.session_state:
            st.session_state.update(am_keys_for=gkey, am_keys=(0, end))
        k0, k1 = st.slider("Key positions shown (zoom)", 0, end, key="am_keys", step=max(1, end // 512),
                           help=f"the x axis of both maps; above {AC.MAX_COLS} keys a drawn cell is a block of keys "
                                "(its largest |w|), so a narrower range shows finer blocks. The CSV has every entry")
        if k1 > k0 and (k0, k1) != (0, end):
            keys = (int(k0), int(k1))
    cols = st.columns(2)
    with cols[0]:
        _map_chart((cache, gkey, "gdn", f"GDN layer {meta['layer']} head {meta['head']}: exact map", tuple(sub_g),
                    keys), t, cache, gkey, f"{tag}_gdn_map", "ch_am_gdn")
    if soft is not None:
        p, sm = soft
        who = "mean over heads" if sm["head"] is None else f"head {sm['head']}"
        sub_s = ["softmax_s(q_t·k_s/√d), the layer's post-RoPE q, k: rows sum to 1",
                 "log colour, 10⁻⁴ and below darkest; blank: s > t"]
        with cols[1]:
            stag = f"L{sm['layer']}{'mean' if sm['head'] is None else 'H' + str(sm['head'])}_q{start}-{end - 1}"
            _map_chart((cache, skey, "softmax", f"Softmax: attention layer {sm['layer']}, {who}", tuple(sub_s), keys),
                       t, cache, skey, f"{stag}_softmax", "ch_am_soft")
    c = st.columns([1, 3])
    t = int(c[0].number_input("Query position t (or click a row of a map)", min_value=start, max_value=end - 1,
                              key="am_row", help="the top keys of this query in both maps, below"))
    b, _ = AC.context(tokens, t, 16, 0)
    c[1].html(f"<div style='padding-top:1.9em'><b>Query t = {t:,}</b>: <span style='font-family:monospace'>…"
              f"{_esc(b)}<mark>{_esc(tokens[t])}</mark></span></div>")
    cfg = {"rank": st.column_config.NumberColumn("#", width="small"), "key": "key s", "tokens_back": "t − s",
           "context": st.column_config.TextColumn("key in context", width="large",
                                                  help="the 6 tokens before the key, [the key], the 3 after "
                                                       "(↵: a newline)"),
           "weight": st.column_config.NumberColumn("w_t,s", format="%.4g"),
           "share": st.column_config.NumberColumn("share of Σ|w|", format="percent")}
    # one table under the other, each the page's width, so that the key's context is read whole
    st.markdown("**GDN map: top keys** (largest |w_t,s|)")
    st.dataframe(AC.top_keys(w, start, tokens, t), hide_index=True, width="stretch", height="content",
                 column_config=cfg, column_order=SHOWN)
    if soft is not None:
        st.markdown("**Softmax: top keys** (largest probability)")
        st.dataframe(AC.top_keys(p, start, tokens, t), hide_index=True, width="stretch", height="content",
                     column_order=SHOWN,
                     column_config={**cfg, "weight": st.column_config.NumberColumn("p_t,s", format="%.4g")})


def _esc(s: str) -> str:
    import html

    return html.escape(s).replace("\n", "↵ ")


def _new_click(which: str, ev, picked: int | None) -> int | None:
    """The query a click on map ``which`` selected if it differs from that map's previous selection, else
    ``picked``."""
    q, k = _clicked(ev), f"am_click_{which}"
    if q != st.session_state.get(k):
        st.session_state[k] = q
        return q if q is not None else picked
    return picked


def _clicked(ev) -> int | None:
    """The first query of the block a click selected on a map, or None."""
    try:
        pts = ev["selection"]["row"]
    except (TypeError, KeyError):
        return None
    if not pts:
        return None
    q = pts[0].get("q0") if isinstance(pts, list) else None
    return None if q is None else int(q)
