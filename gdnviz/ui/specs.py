"""Altair charts as Vega-Lite specs for the page, built without Altair's JSON-schema validation.

Validating a layered chart against the Vega-Lite schema costs 50–300 ms per chart on every rerun (most of the
time a page took); the chart builders of ``gdnviz.figures`` are validated by tests/test_figures.py instead. Inside
``fast_build`` Altair also looks up its schema classes in one table built once (``_one_class_table``).

``spec(chart)`` → a plain Vega-Lite dict with its data inline under ``"datasets"`` (lists of records), the form
vl-convert exports and ``st.cache_data`` stores; ``for_page(spec)`` → the same spec with each dataset a DataFrame,
which Streamlit sends as Arrow.
"""
from __future__ import annotations

from contextlib import contextmanager

import pandas as pd


def _one_class_table() -> None:
    """Make Altair build its table of schema classes once per process instead of once per channel.

    Altair 6.3 turns every channel given as a string or a dict (``x="erank:Q"``, ``"document"`` in a tooltip,
    ``alt.value(3)``) into its class with ``SchemaBase.from_dict``, which first hashes the JSON of all ~570 schema
    classes into a lookup table (``_FromDict.__init__``): 2–4 ms per channel, about half of the time a Head page
    figure took to build. The table depends only on the set of classes, so it is kept per set of classes here (what
    vega/altair#3547 proposes upstream). The charts built are the same (tests/test_figures.py)."""
    from altair.utils import schemapi

    cls = schemapi._FromDict
    if getattr(cls, "_one_table", False):
        return
    build = cls.__init__
    tables: dict[tuple, dict] = {}

    def __init__(self, wrapper_classes, /) -> None:
        key = tuple(wrapper_classes)
        if key not in tables:
            build(self, key)
            tables[key] = self.class_dict
        self.class_dict = tables[key]

    cls.__init__, cls._one_table = __init__, True


@contextmanager
def fast_build():
    """Altair objects built inside skip their construction-time schema validation (and share Altair's table of
    schema classes: ``_one_class_table``)."""
    from altair.utils import schemapi

    _one_class_table()
    with schemapi.debug_mode(False):
        yield


def spec(chart) -> dict:
    """The Vega-Lite spec of an Altair chart (or a spec dict, returned as is), data inline, unvalidated."""
    if isinstance(chart, dict):
        return chart
    with fast_build():
        d = chart.to_dict(validate=False)
    view = d.get("config", {}).get("view", {})
    for k in ("continuousWidth", "continuousHeight"):  # Altair's default theme; the charts set their own size
        view.pop(k, None)
    return d


def for_page(s: dict) -> dict:
    """``s`` with each inline dataset as a DataFrame (Streamlit serialises those as Arrow)."""
    ds = s.get("datasets") or {}
    return {**s, "datasets": {k: pd.DataFrame.from_records(v) if isinstance(v, list) else v for k, v in ds.items()}}
