"""Turn the Truncate & compare page's head groups into a truncation spec (pure: no Streamlit).

A group is ``{"mode": ..., "r": rank, ...}`` (r as typed: an int, or a whole float from a number field) with mode
``"picked"`` (``heads``: [[layer, head], ...], kept in step with the heatmap's truncation set), ``"heads"``
(``heads``: a list of its own, e.g. one rank of a rank budget: ``groups_from_rank_map``), ``"layers"`` (``layers``:
[layer, ...]),
``"horizon"`` (``filter``: "within" | "beyond" | "range", ``lo``, ``hi`` in tokens; needs a head table) or
``"all"``. Later groups override earlier ones for a head in both.
"""
from __future__ import annotations

MODES = {
    "picked": "heads picked on the heatmap",
    "heads": "a list of heads",
    "layers": "whole layers",
    "horizon": "a horizon filter",
    "all": "all GDN heads",
}
HORIZON_FILTERS = {
    "within": "heads forgetting within a segment (horizon < L)",
    "beyond": "heads remembering beyond a segment (horizon ≥ L)",
    "range": "horizon in a range",
}


def group_heads(group: dict, info: dict, table=None, segment_len: int | None = None) -> list:
    """The (layer, head) pairs a group selects."""
    gl, H = list(info["gdn_layers"]), int(info["num_heads"])
    mode = group.get("mode", "all")
    if mode == "all":
        return [(l, h) for l in gl for h in range(H)]
    if mode == "layers":
        return [(int(l), h) for l in group.get("layers", []) for h in range(H)]
    if mode in ("picked", "heads"):
        return [(int(l), int(h)) for l, h in group.get("heads", [])]
    if mode == "horizon":
        if table is None:
            raise ValueError("a horizon filter needs a capture (the horizons come from it): run one on the Model & "
                             "documents page, or choose heads another way")
        hz = table.set_index(["layer", "head"])["horizon"]
        f = group.get("filter", "within")
        if f == "within":
            ok = hz < float(segment_len)
        elif f == "beyond":
            ok = hz >= float(segment_len)
        else:
            ok = (hz >= float(group.get("lo", 0))) & (hz <= float(group.get("hi", float("inf"))))
        return [(int(l), int(h)) for (l, h), v in ok.items() if v]
    raise ValueError(f"unknown head selection {mode!r}")


def resolve(groups: list, info: dict, table=None, segment_len: int | None = None) -> tuple[dict, list]:
    """({(layer, head): r}, [number of heads per group]); raises RankOutOfRange / ValueError for bad input."""
    from types import SimpleNamespace

    from gdnviz.truncation import TruncationSpec, check_rank

    ranks, counts = {}, []
    rmax = min(int(info["d_k"]), int(info["d_v"]))
    for g in groups:
        heads = group_heads(g, info, table, segment_len)
        counts.append(len(heads))
        r = g.get("r")
        r = int(r) if isinstance(r, float) and r.is_integer() else r  # 4.0 from a number field is 4; 2.5 is refused
        for lh in heads:
            ranks[lh] = check_rank(r, f" for layer {lh[0]} head {lh[1]}", upper=rmax)
    ns = SimpleNamespace(gdn_layers=tuple(info["gdn_layers"]), num_heads=int(info["num_heads"]),
                         d_k=int(info["d_k"]), d_v=int(info["d_v"]))
    TruncationSpec.from_dict(ranks).validate(ns)
    return ranks, counts


def groups_from_rank_map(ranks: dict) -> list[dict]:
    """A per-head rank map ``{(layer, head): r}`` (a rank budget, an imported rank_map.json) as groups: one
    ``"heads"`` group per distinct r, in increasing r; ``resolve`` gives the map back."""
    by_r: dict = {}
    for (l, h), r in sorted(ranks.items()):
        by_r.setdefault(int(r), []).append([int(l), int(h)])
    return [dict(mode="heads", heads=heads, r=r) for r, heads in sorted(by_r.items())]


_READOUT_WORDS = {"segment-graph": "CUDA-graph windows", "aligned-rows": "batch rows on one boundary grid",
                  "segment-loop": "segment loop", "one-call": "one kernel call where no boundary falls",
                  "one-pass": "one pass", "decode-graph": "decode steps replayed from a CUDA graph"}


def readout_note(readouts) -> str:
    """' · truncated run: …' naming how the truncated run's GDN layers ran, prefill and decoding
    (``Generation.readouts``), or ''."""
    words = [_READOUT_WORDS.get(r, r) for r in (readouts or [])]
    return f" · truncated run: {', '.join(words)}" if words else ""
