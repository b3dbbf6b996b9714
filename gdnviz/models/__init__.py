"""Load GDN hybrids and talk to their GDN layers through one adapter per family.

``load(name_or_path, device=, dtype=)`` → ``LoadedModel(model, adapter, info, tokenizer)``;
``inspect_model(name_or_path)`` describes a checkpoint without loading its weights.
"""
from gdnviz.models.info import ModelInfo
from gdnviz.models.loader import (DEMO_NAME, FAMILIES, FAMILY_NAMES, LoadedModel, from_model, inspect_model, load,
                                  resolve)

__all__ = ["ModelInfo", "LoadedModel", "load", "inspect_model", "from_model", "resolve", "DEMO_NAME", "FAMILIES",
           "FAMILY_NAMES"]
