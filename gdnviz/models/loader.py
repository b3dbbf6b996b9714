"""Find, inspect and load a GDN hybrid: a local directory, the local Hugging Face cache, or the bundled demo.

Nothing is ever downloaded (``local_files_only=True``); ``trust_remote_code`` is off unless asked. With it on, a
checkpoint whose config.json ``auto_map`` names code in its folder is loaded with that code (transformers imports
and runs those ``*.py`` files); its family is the supported family its config class derives from, and its
fingerprint covers those files, so results of its code are never mixed with those of the built-in classes.
"""
from __future__ import annotations

import hashlib
import json
import os
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError

from gdnviz.errors import (BadConfig, BadDeviceMap, BadWeights, ModelNotFound, NeedsRemoteCode, NotAGDNModel,
                           NotAModelDirectory, UnsupportedFamily, WeightsMissing)
from gdnviz.models import placement
from gdnviz.models.info import ModelInfo

DEMO_NAME = "demo"
DEMO_DIR = Path(__file__).resolve().parent.parent / "assets" / "demo"

FAMILIES = {
    "qwen3_5": "qwen3_5", "qwen3_5_text": "qwen3_5",
    "qwen3_5_moe": "qwen3_5_moe", "qwen3_5_moe_text": "qwen3_5_moe",
    "qwen3_next": "qwen3_next",
    "gated_deltanet": "fla",
}
FAMILY_NAMES = {
    "qwen3_5": "Qwen3.5 (qwen3_5 / qwen3_5_text)",
    "qwen3_5_moe": "Qwen3.5-MoE (qwen3_5_moe / qwen3_5_moe_text)",
    "qwen3_next": "Qwen3-Next (qwen3_next)",
    "fla": "fla GatedDeltaNet (gated_deltanet)",
}
WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.pt", "*.pth")


def supported_families_text() -> str:
    return ", ".join(FAMILY_NAMES.values())


def resolve(name_or_path: str | os.PathLike | None) -> Path:
    """Directory holding config.json for: the bundled demo ("demo" / None), a local path, or a cached hub id."""
    if name_or_path is None or str(name_or_path) == DEMO_NAME:
        if not (DEMO_DIR / "config.json").exists():
            raise ModelNotFound(f"the bundled demo model is not installed at {DEMO_DIR}")
        return DEMO_DIR
    p = Path(os.path.expanduser(str(name_or_path)))
    if p.exists():
        if not p.is_dir():
            raise NotAModelDirectory(f"{p} is a file, not a model directory: give the folder that holds config.json")
        if not (p / "config.json").exists():
            raise NotAModelDirectory(
                f"{p} is not a model directory: it has no config.json. Give the folder of a Hugging Face checkpoint "
                "(config.json + *.safetensors), e.g. the snapshot folder under ~/.cache/huggingface/hub.")
        return p
    name = str(name_or_path)
    if name.count("/") == 1 and not name.startswith((".", "/", "~")):
        try:
            from huggingface_hub import snapshot_download

            return Path(snapshot_download(name, local_files_only=True))
        except Exception as e:  # LocalEntryNotFoundError, RepositoryNotFoundError, ...
            raise ModelNotFound(
                f"'{name}' is not in the local Hugging Face cache ({_hf_cache_dir()}) and nothing can be downloaded "
                f"here. On a machine with internet run `hf download {name}` (or huggingface-cli download) and copy "
                f"the cache folder over, or pass the checkpoint's local directory. ({type(e).__name__})") from None
    raise ModelNotFound(f"no model called '{name}': not a local directory, not 'demo', not an org/name in the "
                        f"local Hugging Face cache ({_hf_cache_dir()})")


def _hf_cache_dir() -> str:
    try:
        from huggingface_hub.constants import HF_HUB_CACHE

        return str(HF_HUB_CACHE)
    except Exception:
        return "~/.cache/huggingface/hub"


def read_raw_config(path: Path) -> dict:
    """``path/config.json`` as a dict; ``BadConfig`` naming the file when it is not JSON or not a JSON object."""
    cfg = path / "config.json"
    try:
        raw = json.loads(cfg.read_bytes())
    except (ValueError, UnicodeDecodeError) as e:
        raise BadConfig(f"{cfg} is not valid JSON ({e}): fix or replace the checkpoint's config.json") from None
    if not isinstance(raw, dict):
        raise BadConfig(f"{cfg} holds a {type(raw).__name__}, not a JSON object: a model config is one object "
                        "{\"model_type\": ..., ...}")
    return raw


def read_config(path: Path, trust_remote_code: bool = False):
    """(transformers config, raw config.json dict, family) of the checkpoint at ``path``. Raises BadConfig,
    NeedsRemoteCode (its model_type exists only in its own code, and ``trust_remote_code`` is off),
    UnsupportedFamily or NotAGDNModel."""
    from transformers import AutoConfig

    _register_fla()
    raw = read_raw_config(path)
    model_type = raw.get("model_type")
    code = remote_code(raw)
    if model_type not in FAMILIES and code and not _builtin(model_type):
        if not trust_remote_code:
            raise NeedsRemoteCode(
                f"{path}: model_type '{model_type}' is defined only by the checkpoint's own Python code (config.json "
                f"auto_map: {', '.join(f'{k} → {v}' for k, v in code.items())}), which is not run unless you allow "
                "it. If you trust this folder, tick 'Trust remote code' on the Model & documents page (CLI: "
                "--trust-remote-code; library: trust_remote_code=True): its code then runs on this machine.")
        config = AutoConfig.from_pretrained(path, local_files_only=True, trust_remote_code=True)
        family = next((FAMILIES[t] for t in _base_model_types(type(config)) if t in FAMILIES), None)
        if family is None:
            raise UnsupportedFamily(
                f"{path}: the checkpoint's own config class {type(config).__name__} (model_type '{model_type}') "
                f"derives from none of the supported families' configs. Supported families: "
                f"{supported_families_text()}.")
        return config, raw, family
    if model_type not in FAMILIES:
        types = raw.get("layer_types") or (raw.get("text_config") or {}).get("layer_types")
        found = _layer_type_summary(types) if types else f"{raw.get('num_hidden_layers', '?')} layers, none declared linear_attention"
        if types and any("linear" in str(t) for t in types):
            raise UnsupportedFamily(
                f"model_type '{model_type}' has linear-attention layers but no gdnviz adapter. "
                f"Supported families: {supported_families_text()}.")
        raise NotAGDNModel(f"model_type '{model_type}' has no Gated DeltaNet layers (found layer types: {found}). "
                           f"gdnviz inspects GDN hybrids: {supported_families_text()}.")
    config = AutoConfig.from_pretrained(path, local_files_only=True, trust_remote_code=trust_remote_code)
    if trust_remote_code and code and type(config).__module__.startswith("transformers_modules"):
        family = next((FAMILIES[t] for t in _base_model_types(type(config)) if t in FAMILIES), FAMILIES[model_type])
    else:
        family = FAMILIES[model_type]
    return config, raw, family


def remote_code(raw: dict) -> dict:
    """config.json's ``auto_map`` (Auto class -> "module.Class" in the checkpoint's folder), {} when it has none."""
    m = raw.get("auto_map")
    return {str(k): str(v) for k, v in m.items()} if isinstance(m, dict) else {}


def _builtin(model_type) -> bool:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    return isinstance(model_type, str) and model_type in CONFIG_MAPPING


def _base_model_types(cls) -> list:
    """The ``model_type`` of each config class ``cls`` derives from, itself first."""
    return [getattr(c, "model_type", None) for c in cls.__mro__]


def _layer_type_summary(types) -> str:
    from collections import Counter

    c = Counter(types)
    return ", ".join(f"{t} ×{n}" for t, n in c.items())


def _register_fla() -> None:
    """Register fla's model classes with transformers' Auto* (fla registers them when imported)."""
    try:
        import fla.models  # noqa: F401
    except Exception:
        pass


def adapter_for(family: str):
    if family == "fla":
        from gdnviz.models.fla_family import FlaGDNAdapter

        return FlaGDNAdapter()
    from gdnviz.models.transformers_family import TransformersGDNAdapter

    return TransformersGDNAdapter(family)


def weight_files(path: Path) -> list[Path]:
    files = []
    for pat in WEIGHT_PATTERNS:
        files += sorted(path.glob(pat))
    return files


def fingerprint(path: Path, trust_remote_code: bool = False) -> str:
    """16 hex chars of the sha256 of config.json and each weight file's name and whole-file sha256: it changes
    whenever a weight changes, and is the same for a copy of the checkpoint. Each file is read once per version
    (``gdnviz.models.filehash``); later calls only stat it. With ``trust_remote_code`` and code in the folder
    (config.json ``auto_map``), the name and bytes of every ``*.py`` file there are hashed too: results computed
    by the checkpoint's own code never share a key with those of the built-in classes, nor with an edited copy
    of that code."""
    from gdnviz.models.filehash import file_sha256

    h = hashlib.sha256((path / "config.json").read_bytes())
    for f in weight_files(path):
        h.update(f"{f.name}:{f.stat().st_size}:{file_sha256(f)}".encode())
    if trust_remote_code and remote_code(read_raw_config(path)):
        h.update(b"trust_remote_code")
        for f in sorted(path.glob("*.py")):
            h.update(f.name.encode() + b":" + hashlib.sha256(f.read_bytes()).digest())
    return h.hexdigest()[:16]


def parse_dtype(dtype: Any, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    names = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float16": torch.float16, "fp16": torch.float16}
    if dtype not in names:
        raise ValueError(f"dtype must be one of {sorted(names)} or 'auto', got {dtype!r}")
    return names[dtype]


def parse_device(device: Any) -> torch.device:
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for but no CUDA GPU is visible to this process")
    return dev


def inspect_model(name_or_path=None, trust_remote_code: bool = False) -> dict:
    """What ``load`` would load, without loading weights: family, layers, heads, widths (a dict for the UI)."""
    path = resolve(name_or_path)
    config, raw, family = read_config(path, trust_remote_code)
    ad = adapter_for(family)
    d = ad.describe(config)
    if not d["gdn_layers"]:
        raise NotAGDNModel(f"{path}: model_type '{raw['model_type']}' but no Gated DeltaNet layers (found layer "
                           f"types: {_layer_type_summary(ad.layer_types(config))})")
    if not weight_files(path):
        raise WeightsMissing(f"{path} has a config.json but no weight files (*.safetensors or *.bin). If this is a "
                             "hub snapshot, its weights were never downloaded: fetch them on a machine with internet "
                             "(`hf download <org/name>`) and copy them here.")
    return dict(path=str(path), family=family, **d)


@dataclass
class LoadedModel:
    """A loaded model with its adapter and description. ``model`` is the transformers/fla CausalLM module."""

    model: Any
    adapter: Any
    info: ModelInfo
    tokenizer: Any = None

    @property
    def device(self) -> torch.device:
        """Where inputs go: the model's device, or for a model spread over several (``info.device_map``) its input
        embeddings' device; each GDN layer runs on its own (``gdnviz.models.placement``)."""
        return torch.device(self.info.device)


def load(name_or_path=None, device: Any = "auto", dtype: Any = "auto", trust_remote_code: bool = False,
         load_tokenizer: bool = True, device_map: Any = None) -> LoadedModel:
    """Load a GDN hybrid for inspection.

    name_or_path: "demo"/None (the bundled demo), a local checkpoint directory, or "org/name" in the local HF cache.
    device: "auto" (cuda if available), "cpu", "cuda", "cuda:1"...; dtype: "auto" (bf16 on CUDA, fp32 on CPU),
    "float32", "bfloat16", "float16". device_map: None (the whole model on ``device``), "auto" or
    ``{module name: device}`` (a dict or its JSON text; ``gdnviz.models.placement``): transformers places each
    module there; with a map ``device`` must stay "auto", and "auto" dtype is bf16 when a module runs on a GPU. A map
    that puts everything on one device is the plain load on that device. trust_remote_code: run the checkpoint's own
    code (module docstring). Raises ModelNotFound, NotAModelDirectory, WeightsMissing, NeedsRemoteCode,
    UnsupportedFamily, NotAGDNModel, BadDeviceMap or BadWeights with a message that says what to do.
    """
    from transformers import AutoModelForCausalLM

    desc = inspect_model(name_or_path, trust_remote_code)
    path = Path(desc["path"])
    family = desc["family"]
    ad = adapter_for(family)
    config, _, _ = read_config(path, trust_remote_code)
    requested = placement.parse(device_map)
    dmap = None
    if requested is None:
        dev = parse_device(device)
    else:
        if device not in (None, "auto"):
            raise BadDeviceMap(f"give a device ({device!r}) or a device_map, not both: the map says where every "
                               "module goes")
        dev = parse_device("auto") if requested == "auto" else placement.main_device(requested)
    dt = parse_dtype(dtype, dev)
    config = ad.adjust_config(config, dev) if hasattr(ad, "adjust_config") else config
    if requested is not None:
        meta = _meta_model(config, dt, trust_remote_code)
        dmap = placement.plan(meta, requested)
        if placement.spans_devices(dmap):
            dev = placement.device_of(dmap, _module_name(meta, meta.get_input_embeddings()))
        else:  # one device: the plain load there
            dev, dmap = torch.device(next(iter(dmap.values()))), None
        del meta
    placed = {} if dmap is None else dict(device_map=placement.for_transformers(dmap))
    try:
        model = AutoModelForCausalLM.from_pretrained(path, config=config, dtype=dt, local_files_only=True,
                                                     trust_remote_code=trust_remote_code, **placed)
    except (SafetensorError, OSError, EOFError, pickle.UnpicklingError) as e:
        names = ", ".join(f.name for f in weight_files(path))
        raise BadWeights(f"The weights in {path} ({names}) cannot be read: a weight file is damaged or truncated "
                         f"({type(e).__name__}: {str(e)[:200]}). Copy or download it again.") from None
    model = (model.to(dev) if dmap is None else model).eval()
    ad.prepare(model)
    tok = None
    if load_tokenizer:
        tok = load_tokenizer_for(path, trust_remote_code)
    info = ModelInfo(
        name=str(name_or_path or DEMO_NAME), path=str(path), family=family,
        dtype=str(dt).replace("torch.", ""), device=str(dev),
        kernel_path=_kernel_path(placement.main_device(dmap) if dmap else dev),
        fingerprint=fingerprint(path, trust_remote_code),
        num_parameters=sum(p.numel() for p in model.parameters()),
        device_map=tuple(sorted(dmap.items())) if dmap else (),
        **{k: v for k, v in desc.items() if k not in ("path", "family")},
    )
    return LoadedModel(model=model, adapter=ad, info=info, tokenizer=tok)


def _meta_model(config, dtype: torch.dtype, trust_remote_code: bool):
    """The model class of ``config`` built on the meta device (no memory, no weights): its module names and tensor
    sizes are what a device map is checked and planned against."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=trust_remote_code)


def _module_name(model, module) -> str:
    return next(n for n, m in model.named_modules() if m is module)


def from_model(model, name: str = "in-memory", tokenizer=None) -> LoadedModel:
    """Wrap an already-built model (e.g. built from a config in a notebook or test) as a LoadedModel."""
    config = model.config
    mt = config.model_type
    if mt not in FAMILIES:
        raise UnsupportedFamily(f"model_type '{mt}': supported families: {supported_families_text()}")
    family = FAMILIES[mt]
    ad = adapter_for(family)
    desc = ad.describe(config)
    if not desc["gdn_layers"]:
        raise NotAGDNModel(f"model_type '{mt}' but no Gated DeltaNet layers (found layer types: "
                           f"{_layer_type_summary(ad.layer_types(config))})")
    model.eval()
    ad.prepare(model)
    p = next(model.parameters())
    h = hashlib.sha256(json.dumps(config.to_dict(), sort_keys=True, default=str).encode())
    with torch.no_grad():
        for t in list(model.state_dict().values())[:8]:
            h.update(t.float().flatten()[:256].cpu().numpy().tobytes())
    info = ModelInfo(name=name, path="", family=family, dtype=str(p.dtype).replace("torch.", ""),
                     device=str(p.device), kernel_path=_kernel_path(p.device), fingerprint=h.hexdigest()[:16],
                     num_parameters=sum(q.numel() for q in model.parameters()), **desc)
    return LoadedModel(model=model, adapter=ad, info=info, tokenizer=tokenizer)


def _kernel_path(dev: torch.device) -> str:
    from gdnviz.gdn.kernels import backend_for

    return backend_for(dev)


def load_tokenizer_for(path: Path, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=trust_remote_code)
    except Exception:
        return None
