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
    device: where inputs go (the input embeddings' device). device_map: ``((module name, device), ...)`` sorted, when
    the model is spread over several devices (``gdnviz.models.placement``); () when it lives on ``device`` alone.
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
    device_map: tuple = ()

    @property
    def n_gdn_heads(self) -> int:
        return len(self.gdn_layers) * self.num_heads

    @property
    def state_shape(self) -> tuple:
        return (self.d_k, self.d_v)

    @property
    def memo_device(self) -> str:
        """What memo keys hold for where the model ran: the device type ("cuda" / "cpu") on one device; on several,
        "map-" and the digest of the map (a spread model's results are not assumed equal to another placement's)."""
        if not self.device_map:
            return self.device.split(":")[0]
        from gdnviz.models.placement import digest

        return "map-" + digest(dict(self.device_map))

    def to_dict(self) -> dict:
        """A JSON-able dict; ``device_map`` (a {name: device} dict) only when the model is spread."""
        d = asdict(self)
        d["gdn_layers"] = list(self.gdn_layers)
        d["attn_layers"] = list(self.attn_layers)
        if self.device_map:
            d["device_map"] = dict(self.device_map)
        else:
            del d["device_map"]
        return d
