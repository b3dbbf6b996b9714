"""gdnviz: look inside the Gated DeltaNet heads of hybrid language models.

UI-free library: ``gdnviz.models`` (load), ``gdnviz.runner`` (segmented runs with boundary callbacks),
``gdnviz.capture`` (per-head statistics along a document), ``gdnviz.truncation`` (top-r state projection),
``gdnviz.analysis`` (ranks, horizons, key cone), ``gdnviz.probes`` (RULER-style retrieval, loss vs rank).
"""
__version__ = "0.1.0"
