"""What gdnviz knows about a loaded GDN hybrid (a frozen, picklable description)."""
from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class ModelInfo:
    """Static facts about a loaded model.

    gdn_layers / attn_layers: the model's own layer indices (0-based) of its Gated DeltaNet and full-attention
    layers. num_heads: value heads per GDN layer = heads that each carry one state [d_k, d_v].
    num_key_heads: query/key heads per GDN layer (keys are repeated to value heads when fewer).
    attn_kv_heads / attn_head_dim: the full-attention layers' KV heads and width (for cache budgets).
    kernel_path: "fla" (Triton kernels on CUDA) or "torch" (PyTorch, CPU); dtype: torch dtype name.
    fingerprint: hash of config.json and the weight files' names and whole contents (memo keys).
    """

    name: str
    path: str
    family: str
    model_type: str
    num_layers: int
    gdn_layers: tuple
    attn_layers: tuple
    num_heads: int
    num_key_heads: int
    d_k: int
    d_v: int
    conv_kernel: int
    hidden_size: int
    vocab_size: int
    attn_kv_heads: int
    attn_head_dim: int
    dtype: str
    device: str
    kernel_path: str
    fingerprint: str
    num_parameters: int = 0

    @property
    def n_gdn_heads(self) -> int:
        return len(self.gdn_layers) * self.num_heads

    @property
    def state_shape(self) -> tuple:
        return (self.d_k, self.d_v)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["gdn_layers"] = list(self.gdn_layers)
        d["attn_layers"] = list(self.attn_layers)
        return d
