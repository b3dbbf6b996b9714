"""Where a model's modules live: transformers' ``device_map`` ("auto" or ``{module name: device}``), checked.

``parse(value)`` turns what a user, a job spec or the CLI gives into ``None`` (no map: the plain load on one
device), ``"auto"`` or a dict ``{module name: "cpu" | "cuda:N"}``. ``plan(model, value)`` resolves it against the
model built on the meta device (``meta_model``) and returns the map ``from_pretrained`` is then given: "auto" is
transformers' own ``infer_auto_device_map`` over the memory of the devices visible here (whole decoder layers,
``_no_split_modules``); an explicit map is checked first, because transformers silently sends a module the map
leaves out to "cpu" and ignores a name the model lacks. Every problem raises ``BadDeviceMap`` naming the module
or device. The semantics are transformers' (accelerate's hooks move each module's inputs to its device): next to a
GPU, "cpu" means the module's weights are offloaded to host memory and it *executes* on the first GPU of the map.
``device_of(map, name)`` says where a module runs; ``spans_devices(map)`` whether a map needs hooks at all.
"""
from __future__ import annotations

import hashlib
import json
from typing import Any

import torch

from gdnviz.errors import BadDeviceMap

_LIST = 8  # names listed in a message before "… and N more"


def _listed(names) -> str:
    names = list(names)
    more = f" … and {len(names) - _LIST} more" if len(names) > _LIST else ""
    return ", ".join(repr(n) for n in names[:_LIST]) + more


def parse(value: Any) -> None | str | dict:
    """None / "" → None; "auto" → "auto"; a dict or the JSON text of one → ``{name: device string}`` (devices as
    ``torch.device`` spells them, an int N meaning "cuda:N" as in transformers). BadDeviceMap otherwise."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    if isinstance(value, str):
        text = value.strip()
        if text == "auto":
            return "auto"
        if not text.startswith("{"):
            raise BadDeviceMap(f"device_map must be 'auto' or a JSON object {{module name: device}}, got {value!r}")
        try:
            value = json.loads(text)
        except ValueError as e:
            raise BadDeviceMap(f"device_map is not valid JSON ({e}): {text[:200]!r}") from None
    if not isinstance(value, dict) or not value:
        raise BadDeviceMap(f"device_map must be 'auto' or a non-empty {{module name: device}} object, got {value!r}")
    out = {}
    for name, dev in value.items():
        if not isinstance(name, str):
            raise BadDeviceMap(f"device_map keys are module names (strings), got {name!r}")
        out[name] = _device_text(name, dev)
    return out


def _device_text(name: str, dev: Any) -> str:
    if isinstance(dev, bool):
        raise BadDeviceMap(f"device_map[{name!r}] = {dev!r} is not a device")
    if isinstance(dev, int):
        dev = f"cuda:{dev}"
    if isinstance(dev, str) and dev in ("disk", "meta"):
        raise BadDeviceMap(f"device_map[{name!r}] = {dev!r}: gdnviz runs every module on a CPU or a GPU (no disk "
                           "offload, no meta tensors); put it on 'cpu' or a 'cuda:N'")
    try:
        d = torch.device(dev)
    except (RuntimeError, TypeError):
        raise BadDeviceMap(f"device_map[{name!r}] = {dev!r} is not a device: use 'cpu' or 'cuda:N'") from None
    if d.type == "cuda":
        return f"cuda:{0 if d.index is None else d.index}"
    if d.type == "cpu":
        return "cpu"
    raise BadDeviceMap(f"device_map[{name!r}] = {dev!r}: gdnviz runs on 'cpu' and 'cuda:N' devices only")


def check_devices(dmap: dict) -> None:
    """Every device of ``dmap`` exists in this process (BadDeviceMap naming the module and device otherwise)."""
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for name, dev in dmap.items():
        d = torch.device(dev)
        if d.type == "cuda" and d.index >= n:
            have = "no CUDA GPU is visible" if n == 0 else f"this process sees {n} GPU(s): cuda:0 … cuda:{n - 1}"
            raise BadDeviceMap(f"device_map[{name!r}] = {dev!r} does not exist: {have}")


def check_modules(model, dmap: dict) -> None:
    """``dmap``'s names against the model (built on the meta device is enough): each is a module of it ('' = the
    whole model), none lies strictly inside one of the model's ``_no_split_modules`` (a decoder layer must stay on
    one device: its GDN layer uses its conv weight without calling the module, so no hook would move it), and
    tied input and output embeddings share a device, and every parameter and buffer falls under some name.
    BadDeviceMap naming the modules otherwise."""
    modules = dict(model.named_modules())
    unknown = [n for n in dmap if n not in modules]
    if unknown:
        top = [n for n, _ in model.named_children()]
        raise BadDeviceMap(f"device_map names {_listed(unknown)}, which the model ({type(model).__name__}) does not "
                           f"have; its modules are named like {_listed(_examples(model))} (top level: "
                           f"{', '.join(top)})")
    no_split = set(getattr(model, "_no_split_modules", None) or ())
    whole = [n for n, m in modules.items() if n and type(m).__name__ in no_split]
    split = [k for k in dmap for w in whole if k.startswith(w + ".")]
    if split:
        raise BadDeviceMap(f"device_map splits a decoder layer: it places {_listed(split)} apart from the rest of "
                           f"{_listed(sorted({w for w in whole for k in split if k.startswith(w + '.')}))}; map "
                           "each decoder layer whole (e.g. 'model.layers.3')")
    inp, out = model.get_input_embeddings(), model.get_output_embeddings()
    if inp is not None and out is not None and getattr(out, "weight", None) is getattr(inp, "weight", False):
        names = {m: n for n, m in modules.items() if m is inp or m is out}
        a, b = names[inp], names[out]
        if None not in (_entry(dmap, a), _entry(dmap, b)) and _entry(dmap, a) != _entry(dmap, b):
            raise BadDeviceMap(f"device_map puts {a!r} on {_entry(dmap, a)!r} and {b!r} on {_entry(dmap, b)!r}, but "
                               f"the model ties their weights (tie_word_embeddings): map both to the same device")
    missing = _uncovered(model, dmap)
    if missing:
        raise BadDeviceMap(f"device_map leaves {_listed(missing)} out: every module needs a device (transformers "
                           "would put the rest on 'cpu' silently); add them, or map '' for the rest")


def _examples(model) -> list:
    """A few module names a map could use: the top-level children and the first and last decoder layer."""
    names = [n for n, _ in model.named_modules() if n and n.count(".") <= 1]
    layers = [n for n, _ in model.named_modules() if n.count(".") == 2 and ".layers." in n]
    return names + ([layers[0], layers[-1]] if layers else [])


def _covered(name: str, keys) -> bool:
    return any(k == "" or name == k or name.startswith(k + ".") for k in keys)


def _uncovered(model, dmap: dict) -> list:
    """The largest modules none of whose tensors ``dmap`` places (sorted), or [] when every tensor is placed."""
    keys = list(dmap)
    tensors = [n for n, _ in model.named_parameters()] + [n for n, _ in model.named_buffers()]
    loose = [n for n in tensors if not _covered(n, keys)]
    if not loose:
        return []
    total: dict = {}
    for n in tensors:  # tensors under each module prefix, all and loose ones (one pass each)
        for p in _prefixes(n):
            total[p] = total.get(p, 0) + 1
    free: dict = {}
    for n in loose:
        for p in _prefixes(n):
            free[p] = free.get(p, 0) + 1
    # each loose tensor's largest module all of whose tensors are loose (the tensor itself when none is)
    return sorted({next((p for p in _prefixes(n) if free[p] == total[p]), n) for n in loose})


def _prefixes(name: str) -> list:
    """The module names above a tensor name, outermost first: 'a.b.w' -> ['a', 'a.b']."""
    parts = name.split(".")
    return [".".join(parts[:d]) for d in range(1, len(parts))]


def plan(model, value) -> dict:
    """The checked ``{module name: device}`` map for ``value`` (``parse``'s result, not None) on ``model`` (built on
    the meta device in the load's dtype). "auto": transformers' balanced map over the visible devices' memory
    (whole ``_no_split_modules``); it must not need the disk. "auto" and a map over several devices need
    accelerate, as transformers' ``device_map`` does; a map on one device is the plain load and does not."""
    if value == "auto":
        _need_accelerate("device_map='auto'")
        from transformers.integrations.accelerate import _get_device_map

        dmap = {k: _device_text(k, v) if v != "disk" else "disk" for k, v in
                _get_device_map(model, "auto", None, None).items()}
        disk = [k for k, v in dmap.items() if v == "disk"]
        if disk:
            raise BadDeviceMap(f"device_map='auto': the model does not fit the memory of this machine's devices "
                               f"and host ({_listed(disk)} would go to disk, which gdnviz does not offload to); "
                               "use more GPUs or a smaller dtype")
        return dmap
    check_devices(value)
    check_modules(model, value)
    if spans_devices(value):
        _need_accelerate("a device_map over several devices")
    return dict(value)


def _need_accelerate(what: str) -> None:
    try:
        import accelerate  # noqa: F401
    except ImportError:
        raise BadDeviceMap(f"{what} needs the accelerate package (transformers applies the map with its hooks): "
                           "pip install 'accelerate>=1.1'") from None


def spans_devices(dmap: dict | None) -> bool:
    """Whether ``dmap`` puts modules on more than one device (then transformers dispatches with hooks)."""
    return bool(dmap) and len(set(dmap.values())) > 1


def main_device(dmap: dict) -> torch.device:
    """Where the map's offloaded ("cpu") modules execute: accelerate's main device, the first GPU of the map in
    index order (``dispatch_model`` takes any GPU of the map; this is the one ``execution_device`` finds), or the
    CPU when the map has no GPU."""
    gpus = sorted({torch.device(d).index for d in dmap.values() if torch.device(d).type == "cuda"})
    return torch.device(f"cuda:{gpus[0]}") if gpus else torch.device("cpu")


def text(dmap: dict | None) -> str:
    """Canonical JSON of a map (sorted names), "" for None: what specs, keys and records hold."""
    return "" if not dmap else json.dumps(dict(sorted(dmap.items())), separators=(",", ":"))


def digest(dmap: dict) -> str:
    """12 hex chars naming a map in memo keys."""
    return hashlib.sha256(text(dmap).encode()).hexdigest()[:12]


def for_transformers(dmap: dict) -> dict:
    """``dmap`` as ``from_pretrained`` is given it: GPUs as their index (accelerate picks its main device from the
    set of the map's values; ints make that the lowest index, as ``main_device`` says), "cpu" as is."""
    return {k: torch.device(v).index if v.startswith("cuda") else v for k, v in dmap.items()}


def device_of(dmap: dict, name: str) -> torch.device:
    """Where the module ``name`` executes under ``dmap``: the device of the most specific entry that covers it, or
    the main device for an offloaded ("cpu" next to a GPU) one."""
    dev = torch.device(_entry(dmap, name))
    return main_device(dmap) if dev.type == "cpu" else dev


def _entry(dmap: dict, name: str) -> str | None:
    """The device of the most specific entry of ``dmap`` that covers the module or tensor ``name`` (None: none)."""
    keys = [k for k in dmap if k == "" or name == k or name.startswith(k + ".")]
    return dmap[max(keys, key=len)] if keys else None
