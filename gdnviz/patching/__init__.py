"""State patching between prompts: run prompt B with chosen heads' states at one boundary replaced by prompt A's,
and compare answers and the loss (docs/attribution.md, "State patching between prompts")."""
from gdnviz.patching.callback import DonorStates, PatchCallback
from gdnviz.patching.compare import (VERSION, comparison_table, continuation_nll, patch_key, patch_prompts,
                                     states_table)
from gdnviz.patching.pairs import NeedlePair, continuation_ids, needle_pair, pair_inputs
from gdnviz.patching.spec import PatchSpec, check_boundary, check_patch, last_boundary, resolve_patch_heads

__all__ = ["DonorStates", "NeedlePair", "PatchCallback", "PatchSpec", "VERSION", "check_boundary", "check_patch",
           "comparison_table", "continuation_ids", "continuation_nll", "last_boundary", "needle_pair", "pair_inputs",
           "patch_key", "patch_prompts", "resolve_patch_heads", "states_table"]
