"""Probes: prompts with a known right answer, to see what a GDN head's memory is used for.

``gdnviz.probes.ruler``: RULER-style synthetic long-context tasks generated fully offline (``niah_single_1``,
``niah_multikey_2``, ``niah_multikey_3``, ``vt``, ``cwe``, ``fwe``), sized to a target length with the model's
own tokenizer, and RULER's string-match scoring (``generate``, ``generate_many``, ``score``, ``TASKS``).
"""
