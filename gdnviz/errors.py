"""Specific exceptions of the gdnviz library. Pages turn them into ``st.error`` with what to do next.

Every exception carries a message written for the user: what went wrong and what to do about it.
"""


class GDNVizError(Exception):
    """Base class of every error gdnviz raises on purpose."""


# --- loading -------------------------------------------------------------------------------------
class ModelNotFound(GDNVizError):
    """The name is neither a local directory, the bundled demo, nor a model in the local HF cache."""


class NotAModelDirectory(GDNVizError):
    """A local path exists but holds no ``config.json``."""


class WeightsMissing(GDNVizError):
    """A config was found but no weight files (``*.safetensors`` / ``*.bin``) beside it."""


class BadConfig(GDNVizError):
    """``config.json`` is not valid JSON, or not a JSON object."""


class BadWeights(GDNVizError):
    """A weight file cannot be read: truncated or damaged."""


class UnsupportedFamily(GDNVizError):
    """The config's ``model_type`` is none of the families gdnviz has an adapter for."""


class NeedsRemoteCode(GDNVizError):
    """The checkpoint's model_type is only defined by Python code in its folder (config.json ``auto_map``), and
    running that code was not allowed (``trust_remote_code``)."""


class NotAGDNModel(GDNVizError):
    """The config declares no Gated DeltaNet (``linear_attention``) layers."""


class BadDeviceMap(GDNVizError):
    """A ``device_map`` names a module the model does not have, a device that does not exist here, leaves a module
    out, splits a decoder layer, cannot be parsed, or cannot be applied (accelerate missing, disk offload)."""


# --- inputs --------------------------------------------------------------------------------------
class EmptyDocument(GDNVizError):
    """A document is empty or whitespace only."""


class NotText(GDNVizError):
    """An upload is binary or not valid UTF-8."""


class DocumentTooLong(GDNVizError):
    """A document has more tokens than the configured limit."""


class DocumentTooShort(GDNVizError):
    """A document has fewer tokens than a probe needs (e.g. no prediction after the first segment boundary)."""


class RankOutOfRange(GDNVizError):
    """A truncation rank is outside 1..min(d_k, d_v)."""


class BadSegmentLength(GDNVizError):
    """A segment length is not a positive integer."""


class BadTokenLimit(GDNVizError):
    """A per-document token limit is not a positive integer."""


class UnknownTask(GDNVizError):
    """A probe task name is not one gdnviz generates."""


class TaskTooShort(GDNVizError):
    """A target length is below what a task needs."""


class EmptyDocumentSet(GDNVizError):
    """A probe was asked to run over no documents."""


class EmptyHeadSet(GDNVizError):
    """A scan or budget was asked to work on no heads (no layers, or no heads in the chosen layers)."""


class TooFewSamples(GDNVizError):
    """n is too small for the statistical test asked for (a paired standard error needs n >= 2)."""


class TooManyPrompts(GDNVizError):
    """A scan or budget would generate more answers than the limit set for it, or a sweep's prompts would not fit
    in memory; nothing was run."""


# --- running -------------------------------------------------------------------------------------
class GPUOutOfMemory(GDNVizError):
    """The device ran out of memory; the message says how much was asked and what to reduce."""


class WorkerCrashed(GDNVizError):
    """The worker process died while running a job."""


class JobCancelled(GDNVizError):
    """The user cancelled a running job."""


# --- the store ---------------------------------------------------------------------------------
class CorruptStoreEntry(GDNVizError):
    """An entry of the on-disk store (a previous run, a job record, ...) cannot be read: damaged or truncated."""


# --- settings ------------------------------------------------------------------------------------
class BadSetting(GDNVizError):
    """An environment variable of ``gdnviz.settings`` holds a value its kind cannot parse."""


class ClusterError(GDNVizError):
    """A Dask cluster cannot run the work: no scheduler answers, workers disagree with this process (gdnviz code,
    model), a worker cannot load the model, or Dask is not installed."""


# --- attribution ---------------------------------------------------------------------------------
class LayerNotGDN(GDNVizError):
    """A layer index names no Gated DeltaNet layer (a full-attention layer, or no layer at all)."""


class HeadOutOfRange(GDNVizError):
    """A head index is outside 0..num_heads-1 of a GDN layer."""


class PositionOutOfRange(GDNVizError):
    """A token position (tokens consumed) or window is outside the document."""


class WindowTooLarge(GDNVizError):
    """An attention-map window would need more memory than the stated limit."""


class LayerNotAttention(GDNVizError):
    """A layer index names no full-attention layer (a GDN layer, no layer, or a model without one)."""


# --- patching ------------------------------------------------------------------------------------
class ModelMismatch(GDNVizError):
    """States or a spec made with one model were given to another (their model fingerprints differ)."""
