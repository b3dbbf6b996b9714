"""What a GDN head's state holds: its exact per-token decomposition and the head's exact attention map, with a
full-attention layer's softmax weights to compare (docs/attribution.md). Float64, from the model's own numbers."""
from gdnviz.attribution.exact_map import MAX_MAP_BYTES, attention_map, weights
from gdnviz.attribution.contributions import Contributions, decompose, state_contributions
from gdnviz.attribution.inputs import HeadInputs, head_inputs
from gdnviz.attribution.softmax_map import softmax_weights
from gdnviz.attribution.table import contributions_table

__all__ = ["Contributions", "HeadInputs", "MAX_MAP_BYTES", "attention_map", "contributions_table", "decompose", "head_inputs",
           "softmax_weights", "state_contributions", "weights"]
