"""Device policy: where slotinfer computes, in which dtype, and with which kernels.

CPU: float32 activations always.  MLX's CPU half-precision and quantized
matmuls do not go through BLAS; f32 does, and with the optimized BLAS that
:mod:`slotinfer.cpu.blas` loads it is the fast path for dense weights.  GGUF
Q8_0/Q4_0/Q4_1/Q5_0/Q4_K/Q6_K weights stay in their blocks for slotinfer's own
kernels where those were built (:func:`cpu_block_kernels`), and the other GGUF
types are requantized to Q8_0 at load; without the kernels they are dequantized.
GPU: weights stay as stored (float16 / bfloat16 / float32, quantized kept
quantized) since the GPU kernels are built for them and memory is the limit.

This module only decides; how the CPU is made fast lives in :mod:`slotinfer.cpu`,
and the environment variables that override a decision are read in
:mod:`slotinfer.settings`.
"""

from __future__ import annotations

import dataclasses
import os

from . import settings
from .cpu import allocator, blas

blas.ensure_blas()  # must run before mlx.core is first imported; a no-op after `import slotinfer`

import mlx.core as mx  # noqa: E402

from .cpu.ops import MLX_OPS, Ops, cpu_ops  # noqa: E402
from .errors import InvalidRequestError  # noqa: E402

_DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


def default_device() -> str:
    """``"gpu"`` when MLX's default device is a GPU (Metal or CUDA), else ``"cpu"``."""
    return "gpu" if mx.default_device().type == mx.DeviceType.gpu else "cpu"


def _kind(device) -> str:
    if device is None:
        return default_device()
    if isinstance(device, mx.Device):
        return "gpu" if device.type == mx.DeviceType.gpu else "cpu"
    if isinstance(device, mx.DeviceType):
        return "gpu" if device == mx.DeviceType.gpu else "cpu"
    if isinstance(device, str) and device.lower() in ("cpu", "gpu"):
        return device.lower()
    raise InvalidRequestError(f"device must be 'cpu' or 'gpu' (or an mx.Device), got {device!r}")


def _dtype(value, what: str) -> mx.Dtype:
    if isinstance(value, mx.Dtype) and value in _DTYPES.values():
        return value
    if isinstance(value, str) and value.lower() in _DTYPES:
        return _DTYPES[value.lower()]
    raise InvalidRequestError(
        f"{what} must be one of {', '.join(_DTYPES)} (a name or an mx dtype), got {value!r}")


def dtype_name(dtype: mx.Dtype) -> str:
    return next((k for k, v in _DTYPES.items() if v == dtype), str(dtype).rpartition(".")[2])


def compute_dtype(stored_dtype, device=None, override=None) -> mx.Dtype:
    """The dtype to compute in for weights stored as ``stored_dtype``.

    ``override`` (``"float32"``/``"float16"``/``"bfloat16"`` or an mx dtype)
    wins.  Otherwise CPU computes in float32; GPU keeps the stored float dtype
    (anything else, e.g. float64, becomes float32).
    """
    if override is not None:
        return _dtype(override, "dtype override")
    if _kind(device) == "cpu":
        return mx.float32
    try:
        return _dtype(stored_dtype, "stored dtype")
    except InvalidRequestError:
        return mx.float32


def model_ops(device=None) -> Ops:
    """The one ops object the model computes with (:mod:`slotinfer.cpu.ops`): on CPU the
    own elementwise math (:func:`own_elementwise`), the native extension's RMSNorm, rope and
    decode attention where it is built (``SLOTINFER_NATIVE_OPS=0`` keeps them MLX arithmetic)
    and the split decode attention (:func:`attention_split`); on GPU MLX's own kernels."""
    streams = attention_split(device)
    if own_elementwise(device):
        return cpu_ops(streams, native=settings.native_ops())
    return dataclasses.replace(MLX_OPS, attention_streams=streams) if streams > 1 else MLX_OPS


def own_elementwise(device=None) -> bool:
    """Whether exp-based activations and softmax use :mod:`slotinfer.cpu.fastmath`.

    CPU: yes -- MLX's x86 CPU ``exp`` runs element by element through libm calls, and
    the version written as fused MLX arithmetic is several times faster.  GPU: no, its kernels have a fast ``exp``.  ``SLOTINFER_OWN_MATH=0`` turns it
    off (for comparing the two).
    """
    return _kind(device) == "cpu" and settings.own_math()


def attention_split(device=None) -> int:
    """Into how many concurrent streams a decode step's attention is split (by slots); 1: none.

    CPU: one per core this process may use (its affinity, SMT siblings once, a container's
    CPU quota: :func:`slotinfer.cpu.blas.usable_cores`), up to 8 -- MLX runs each stream's ops
    on its own thread, and attention over every slot's K/V is bound by how fast one core
    reads memory.  More streams than cores only queue behind each other.  GPU: 1, its kernels
    already use the whole device.  ``SLOTINFER_ATTENTION_STREAMS=n`` sets it.
    """
    if _kind(device) != "cpu":
        return 1
    streams = settings.attention_streams()
    return streams if streams is not None else min(blas.usable_cores(), 8)


def prefill_by_layer(device=None) -> int:
    """From how many tokens (rows x width) on a prefill call is evaluated layer by layer; 0: never.

    CPU: 256.  MLX allocates each op's output when the op is queued, ahead of the thread that
    computes it, so a prefill issued as one lazy graph holds several layers' activations at
    once, several times the memory of one layer at a time, for no gain in speed.  Smaller
    calls stay one graph: there the wait at each layer costs more than the memory it saves.
    GPU: never -- a wait per
    layer would leave the device idle while the host queues the next layer's kernels.
    """
    return 256 if _kind(device) == "cpu" else 0


def prefill_micro_batch(device=None) -> int:
    """The most tokens (rows x widest row) one prefill forward computes, whatever the engine's
    prefill budget (0: no cap).  The budget decides how much prompt a step takes in, for
    fairness against the rows decoding; a step's share past this goes through in forwards of
    at most this many tokens, one after another, later pieces of a row reading its earlier
    ones from the pool, so a larger budget never makes a larger working set.  CPU: 512, the
    size from which a prefill's products run at their full rate here (docs/batching.md). GPU:
    no cap -- there one large forward keeps the device busy."""
    return 512 if _kind(device) == "cpu" else 0


def retain_freed_memory(device=None) -> bool:
    """CPU policy on glibc: keep freed memory in the process instead of handing it back
    (:mod:`slotinfer.cpu.allocator` says why).  Returns whether the setting is in force."""
    return _kind(device) == "cpu" and allocator.retain_freed_memory()


def release_free_memory(device=None) -> bool:
    """Hand memory the process no longer uses back to the system, after a rare large release: glibc's
    free heap on CPU (which :func:`retain_freed_memory` keeps, up to 1 GiB), MLX's buffer cache on a
    GPU.  Called once a model is loaded (each tensor is read, and q/k rows reordered, through
    temporaries under the 32 MiB that stay on the heap: a 7B Q4_0 GGUF's process held 1.31x its
    weights once loaded without this, 1.03x with it) and when the K/V pool's arrays are cut back
    after a burst.  Returns whether memory was handed back."""
    if _kind(device) == "cpu":
        return allocator.release_free_memory()
    mx.clear_cache()
    return True


def keep_quantized(device=None, override: bool | None = None) -> bool:
    """Whether quantized weights stay quantized (GPU) or are dequantized at load (CPU)."""
    if override is not None:
        if not isinstance(override, bool):
            raise InvalidRequestError(f"keep_quantized override must be True, False or None, got {override!r}")
        return override
    return _kind(device) == "gpu"


def cpu_block_kernels(device=None) -> bool:
    """Whether a GGUF's Q8_0/Q4_0/Q4_1/Q5_0/Q4_K/Q6_K matrices stay in their blocks, computed by
    slotinfer's own kernels (:mod:`slotinfer.cpu.qkernel`), and its other quantized matrices are
    requantized to Q8_0 blocks (:mod:`slotinfer.cpu.repack`), instead of being dequantized to float32
    at load.

    CPU: yes where the kernels were built at install time.  Measured (docs/quantized-cpu.md): one
    SmolLM2-135M Q4_1 sequence decodes ~4x faster than in float32, 32 sequences at 1.0-1.1x,
    with a fifth of the weight memory.  GPU: no, MLX's
    own quantized kernels serve there.  ``SLOTINFER_QUANT_KERNELS=0`` turns it off, and so does a
    ``dtype`` given to ``load``.  ``SLOTINFER_INT8_ACTIVATIONS=1`` makes the kernels take activations
    in 8 bits (integer dot products, AVX512-VNNI or AVX2): faster products at many rows,
    but other values, off by default (docs/quantized-cpu.md, with its measured agreement).
    """
    if _kind(device) != "cpu" or not settings.quant_kernels():
        return False
    from .cpu import qkernel

    return qkernel.load() is not None


def kv_dtype(compute_dtype, override=None):
    """The dtype K/V are kept in: the model's compute dtype unless ``override`` ("float16",
    "bfloat16", "float32", an mx.Dtype, or "q8_0") says otherwise.  float16 halves K/V memory; on
    CPU the model still computes in float32 and reads K/V back in it.  "q8_0" (returned as that
    string) keeps them in blocks of 32 int8 values and a float16 scale, 0.27x float32's bytes
    (:mod:`slotinfer.kv.quant`)."""
    if override is None:
        return compute_dtype
    if isinstance(override, str) and override.lower() == "q8_0":
        return "q8_0"
    try:
        return _dtype(override, "kv_dtype")
    except InvalidRequestError:
        raise InvalidRequestError(f"kv_dtype must be one of {', '.join(_DTYPES)}, q8_0 (a name, or an mx dtype), "
                                  f"got {override!r}") from None


def kv_memory(device=None) -> int:
    """The memory that holds K/V: the machine's RAM on CPU; MLX's recommended working set on a GPU."""
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return int((_gpu_memory() if _kind(device) != "cpu" else None) or ram)


def prefix_cache_bytes(device=None) -> int:
    """The prefix cache's default cap (cached K/V blocks no request holds): an eighth of
    :func:`kv_memory`, at most 4 GiB."""
    return min(kv_memory(device) // 8, 4 << 30)


def _gpu_memory() -> int | None:
    """The GPU's memory for MLX: its recommended working set where MLX reports one."""
    info = mx.device_info()
    return info.get("max_recommended_working_set_size") or info.get("memory_size")


def memory_available(device=None) -> int | None:
    """Bytes a new allocation may still take here, or None where it cannot be told.

    CPU: the memory the kernel reports available (``MemAvailable``), and no more than what
    an address-space limit (``ulimit -v``, as containers and batch schedulers set) leaves
    this process.  GPU: MLX's recommended working set less what MLX holds.
    """
    if _kind(device) != "cpu":
        total = _gpu_memory()
        return None if not total else max(0, int(total) - mx.get_active_memory())
    found = []
    try:
        with open("/proc/meminfo") as f:
            found += [int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:")]
    except OSError:
        pass
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_AS)
        if soft != resource.RLIM_INFINITY:
            with open("/proc/self/status") as f:
                vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
            found.append(max(0, soft - vm))
    except (ImportError, OSError, StopIteration, ValueError):
        pass
    return min(found) if found else None


def requantized_layout(bits_per_weight: float) -> dict:
    """The MLX affine layout a GGUF weight that MLX has no kernel for (K-quants, I-quants, Q5_0/Q5_1;
    dequantized by gguf's reference at load) is kept in where weights stay quantized
    (:func:`keep_quantized`): groups of 32, 4 bits for types of at most 5 bits a weight (Q2_K to Q4_K,
    the I-quants, Q4_0/Q4_1), 8 bits above (Q5_0, Q5_1, Q5_K, Q6_K, Q8_0).

    Measured on gguf's reading of random blocks of each type (docs/gguf.md): requantizing to 4 bits
    adds 3-11% of the weights' standard deviation in error, less than the 4-bit and smaller types
    already carry and at about the file's own size (5 bits a weight); to 8 bits it adds under 0.6%,
    small beside what 5- and 6-bit types carry, at 9 bits a weight against float16's 16.
    """
    return {"group_size": 32, "bits": 4 if bits_per_weight <= 5 else 8}


def load_threads() -> int:
    """Threads that dequantize a GGUF tensor's blocks at load, on any device (gguf's numpy
    dequantizers run on the host and release the GIL): one per usable core, up to 8."""
    try:
        cores = blas.usable_cores()
    except AttributeError:  # no sched_getaffinity (macOS)
        cores = os.cpu_count() or 1
    return min(cores, 8)


def _quant_kernels_note(device) -> str:
    if device != "cpu":
        return "not used on a GPU (MLX's quantized kernels serve there)"
    from .cpu import qkernel

    state = qkernel.status()
    if not settings.quant_kernels():
        return f"off (SLOTINFER_QUANT_KERNELS=0); {state}"
    return ("on: GGUF Q8_0/Q4_0/Q4_1/Q5_0/Q4_K/Q6_K weights stay quantized, other types as Q8_0, " + state
            if qkernel.load() is not None
            else f"off, GGUF weights are dequantized to float32: {state}")


def _native_ops_note(device) -> str:
    ops = model_ops(device)
    if ops.paged_decode is not None:
        return "on: RMSNorm, rope and decode attention are one native node each"
    if device != "cpu" or not own_elementwise(device):
        return "not used (MLX's own kernels serve)"
    if not settings.native_ops():
        return "off (SLOTINFER_NATIVE_OPS=0)"
    from .cpu import qkernel

    return f"off: the extension is {qkernel.status()}"


def describe() -> dict:
    """What this process runs on: for logs, bug reports and ``slotinfer --version``."""
    device = default_device()
    return {
        "mlx": mx.__version__,
        "device": device,
        "blas": dataclasses.asdict(blas.ensure_blas()),
        "compute_dtype_for_bfloat16": dtype_name(compute_dtype(mx.bfloat16, device)),
        "keep_quantized": keep_quantized(device),
        "quant_kernels": _quant_kernels_note(device),
        "native_ops": _native_ops_note(device),
        "retain_freed_memory": allocator.in_force(),
        "prefill_by_layer_from_tokens": prefill_by_layer(device),
        "prefix_cache_bytes": prefix_cache_bytes(device),
        "cpu_count": os.cpu_count(),
    }
