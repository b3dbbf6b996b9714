"""Turn the Truncate & compare page's head groups into a truncation spec (pure: no Streamlit).

A group is ``{"mode": ..., "r": rank, ...}`` (r as typed: an int, or a whole float from a number field) with mode
``"picked"`` (``heads``: [[layer, head], ...], kept in step with the heatmap's truncation set), ``"heads"``
(``heads``: a list of its own, e.g. one rank of a rank budget: ``groups_from_rank_map``), ``"layers"`` (``layers``:
[layer, ...]),
``"horizon"`` (``filter``: "within" | "beyond" | "range", ``lo``, ``hi`` in tokens; needs a head table) or
``"all"``. Later groups override earlier ones for a head in both. A rank map saved or opened as JSON is
``gdnviz.probes.budget``'s ``rank_map.json`` format (``rank_map_text``, ``rank_map_from_text``).
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
    TruncationSpec.from_dict(ranks).validate(model_shape(info))
    return ranks, counts


def model_shape(info: dict):
    """A page's model info dict as the attributes ``TruncationSpec.validate`` and the rank-map JSON functions read
    (name, fingerprint, gdn_layers, num_heads, d_k, d_v)."""
    from types import SimpleNamespace

    return SimpleNamespace(name=str(info.get("name", "")), fingerprint=str(info.get("fingerprint", "")),
                           gdn_layers=tuple(int(l) for l in info["gdn_layers"]), num_heads=int(info["num_heads"]),
                           d_k=int(info["d_k"]), d_v=int(info["d_v"]))


def rank_map_text(ranks: dict, info: dict) -> str:
    """``{(layer, head): r}`` as rank_map.json (``budget.rank_map_json``), listing only the heads below
    min(d_k, d_v): heads not listed stay untouched, as in a budget's map."""
    from gdnviz.probes.budget import rank_map_json

    rmax = min(int(info["d_k"]), int(info["d_v"]))
    return rank_map_json({lh: int(r) for lh, r in ranks.items() if int(r) < rmax}, model_shape(info))


def rank_map_from_text(text: str, info: dict) -> tuple[dict, str]:
    """({(layer, head): r}, note) from rank_map.json text (or a bare [[layer, head, r], ...] list), validated against
    the model by ``budget.rank_map_from_json``. note: "" or one sentence saying the map names another model (same
    shape, so it applies). Raises GDNVizError (not JSON, no ranks list, a malformed entry, no heads), ValueError
    (a layer that is not GDN, a head out of range) or RankOutOfRange (a rank that is not an integer in 1..rmax)."""
    import json

    from gdnviz.errors import GDNVizError
    from gdnviz.probes.budget import rank_map_from_json

    ranks = rank_map_from_json(text, model_shape(info))
    if not ranks:
        raise GDNVizError("the rank map lists no heads, so every head would stay untouched: there is nothing to "
                          "truncate")
    d = json.loads(text)
    fp, mine = (d.get("fingerprint") or "") if isinstance(d, dict) else "", str(info.get("fingerprint", ""))
    note = ""
    if fp and mine and fp != mine:
        note = (f"This rank map was made for another model ({d.get('model') or 'unnamed'}, fingerprint {fp[:12]}); "
                f"its heads and ranks fit this one, so it is applied as it is.")
    return ranks, note


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
