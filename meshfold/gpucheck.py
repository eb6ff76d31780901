"""What a step would do on CUDA + NCCL, recorded on this CPU: ``meshfold dry-run --device cuda``.

The dry-run (``meshfold/dryrun.py``) builds and steps a representative rank on fake tensors
and torch's fake process group. With ``--device cuda`` the step runs as the trainer runs it
on a GPU (data settings, per-document masks, clipping, the step-end reads) and
``recording()`` watches every operation it dispatches.

Where the tensors live: the fake tensors are CPU tensors underneath, because torch's
autograd engine cannot run a backward over CUDA tensors in a build without CUDA
(``at::getAccelerator()`` finds none: the engine's stream bookkeeping fails, pytorch
#161129). What a GPU run would hold on the host is tracked instead, with the strict mode's
host marks (``comm.HostTensorMode``): inside the step a tensor made without ``device=``, or
only from such tensors, or copied with ``.cpu()``, is a host tensor; everything else (the
model, the batch the prefetcher moved, what the step computes from them) is a device tensor.
On those it records:

- **host syncs**: operations on device tensors that make the host wait for the GPU: scalar
  reads (``.item()``, ``float(t)``, ``bool(t)``, ``.tolist()``), ``nonzero``, boolean-mask
  indexing, ``unique``, ``bincount`` (its CUDA kernel reads the maximum on the host, with or
  without ``minlength``), ``repeat_interleave`` without ``output_size``, ``masked_select``,
  device-to-host copies (``.cpu()``, ``.to("cpu")``). Each is counted at the innermost
  meshfold frame that caused it. Fake tensors have no values: a read is answered with a
  neutral value (1, 1.0, True) and a data-dependent shape with its largest size, and the
  step goes on;
- **attention**: the kernel each attention call gets on an H100 with torch 2.13 (the CUDA
  build's selection rules, ``sdpa_kernel``: flash first, then memory-efficient, then math;
  cuDNN comes after math in the default priority order). ``F.scaled_dot_product_attention``
  is named from its inputs (dtype under autocast, head dim, mask, GQA heads, causal shape);
  direct kernel calls (``models/attention_ops.py``) as ``pick_kernel`` picks them on CUDA. A
  math kernel or a dense [S, S] mask is an error;
- **wire dtypes**: the payload dtype of every collective, by mesh dimension: meshfold's own
  through ``comm.py`` (which names the dimension; control scalars, ``dim=None``, are left
  out), torch's own (FSDP2, DDP, DTensor redistribution) as the c10d operations reach the
  fake process group, named by the group's mesh dimension;
- **gemms**: every matrix multiply by its inputs' dtype (``{dtype: calls}`` per step); an
  fp8 training tensor (torchao's ``Float8TrainingTensor``, ``MXTensor``) by the dtype its
  data is stored in, so the block linears of an fp8 run show as float8. An fp8 GEMM the
  device cannot run is an error: float8 below sm89, MX formats below sm100 (``CAPABILITY``:
  the H100 the attention rules assume), a dimension not a multiple of 16;
- **errors**: a host tensor in a device computation (a host scalar is allowed, as CUDA
  allows it) or in a collective, with the place it came from.

What it cannot show: kernel speed, overlap of NCCL streams with compute, memory
fragmentation, CUDA-only code paths that test ``device.type == "cuda"`` (docs/gpu.md).
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections import Counter, defaultdict

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from meshfold import comm

# Per-document attention (models/attention_ops.py) calls SDPA with one query tile (256) and
# a tile-sized mask; a masked call over more queries than this is a sequence-wide [S, S] mask.
MASKED_QUERY_TILE = 256

_PKG = os.path.dirname(os.path.abspath(__file__))
_SELF = os.path.abspath(__file__)
_aten = torch.ops.aten

# The matrix multiplies ``gemms`` counts (the linears' and the experts' grouped GEMMs).
_GEMMS = ("mm", "addmm", "bmm", "baddbmm", "_scaled_mm", "_grouped_mm", "_scaled_grouped_mm")

# The device the dry-run stands for (an H100: sm90), and what its fp8 GEMMs need.
CAPABILITY = (9, 0)
FP8_CAPABILITY = {"float8": (8, 9), "mx": (10, 0)}

# --------------------------------------------------------------------------- where


# frames that are machinery, not the place a sync comes from (the modes; moe.py's read seam)
_MODES = ("__torch_function__", "__torch_dispatch__", "marked", "read_counts")


# thin wrappers of comm.py's collectives (the tp group's raw ones): a collective's place is their caller
_COMM_WRAPPERS = {(os.path.join(_PKG, "parallel", "tp", "collectives.py"), name)
                  for name in ("all_reduce_", "all_gather", "reduce_scatter")}


def where(skip_comm: bool = False) -> str:
    """``meshfold/<path>:<line>`` of the innermost meshfold frame on the stack (not this module;
    with ``skip_comm``, not comm.py or a wrapper of it)."""
    frame = sys._getframe(1)
    while frame is not None:
        path = frame.f_code.co_filename
        if path.startswith(_PKG) and path != _SELF and frame.f_code.co_name not in _MODES \
                and not (skip_comm and (path == comm.__file__ or (path, frame.f_code.co_name) in _COMM_WRAPPERS)):
            return f"meshfold/{os.path.relpath(path, _PKG)}:{frame.f_lineno}"
        frame = frame.f_back
    return "torch (no meshfold frame)"


# --------------------------------------------------------------------------- attention selection


def _flash_ok(q, k, v, mask, dropout, causal, gqa) -> str | None:
    """Why torch 2.13's flash kernel refuses these inputs on sm90 (None: it takes them)."""
    if mask is not None:
        return "attn_mask given"
    if q.dtype not in (torch.float16, torch.bfloat16):
        return f"dtype {q.dtype}"
    d = q.shape[-1]
    if d > 256 or d % 8 or k.shape[-1] != d or v.shape[-1] != d:
        return f"head dim {d}"
    if causal and q.shape[-2] != k.shape[-2]:
        return "causal with q_len != k_len"
    if q.shape[-3] != k.shape[-3] and not (gqa and q.shape[-3] % k.shape[-3] == 0):
        return "heads differ without enable_gqa"
    return None


def _efficient_ok(q, k, v, mask, dropout, causal, gqa) -> str | None:
    if q.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return f"dtype {q.dtype}"
    align = 4 if q.dtype == torch.float32 else 8
    if q.shape[-1] % align or v.shape[-1] % align or q.shape[-1] > 512:
        return f"head dim {q.shape[-1]}"
    if q.shape[-3] != k.shape[-3]:  # no native GQA in the memory-efficient kernel (torch 2.13)
        return "grouped-query heads (enable_gqa)"
    return None


def sdpa_kernel(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, enable_gqa=False) -> tuple[str, list]:
    """(kernel, reasons the faster ones refused) for ``F.scaled_dot_product_attention`` on an
    H100 with torch 2.13's default priority order (flash, efficient, math)."""
    reasons = []
    for name, ok in (("flash", _flash_ok), ("efficient", _efficient_ok)):
        why = ok(q, k, v, attn_mask, dropout_p, is_causal, enable_gqa)
        if why is None:
            return name, reasons
        reasons.append(f"{name}: {why}")
    return "math", reasons


# --------------------------------------------------------------------------- recorder


_MIX_OK = frozenset({"to", "copy_", "__getitem__", "__setitem__", "cpu", "cuda", "index_put_", "index_put",
                      "__get__", "__set__", "backward", "_make_subclass", "detach", "requires_grad_"})


def _cuda_kind(dtype: torch.dtype, masked: bool) -> str:
    """What ``attention_ops.pick_kernel`` picks for this block on CUDA."""
    if dtype in (torch.float16, torch.bfloat16) and not masked:
        return "flash"
    if dtype in (torch.float16, torch.bfloat16, torch.float32):
        return "efficient"
    return "math"


class _Functions(TorchFunctionMode):
    """Function level: names SDPA's kernel, and finds host tensors mixed into device
    computations (the marks are set at this level, so inner ops of a composite are not
    judged)."""

    def __init__(self, rec: "GpuRecorder"):
        super().__init__()
        self.rec = rec

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            return self._sdpa(func, args, kwargs)
        name = getattr(func, "__name__", "")
        if name not in _MIX_OK:
            host = dev = None
            for t in _tensors(args, kwargs):
                if comm.is_host_marked(t):
                    host = host if host is not None or t.dim() == 0 else t
                else:
                    dev = t
            if host is not None and dev is not None:
                self.rec.error(f"host tensor {host.dtype}{list(host.shape)} in a device computation ({name}) at "
                               f"{where()}: create it with device= or move it with .to(device)")
        if name == "cpu" or (name == "to" and args and isinstance(args[0], torch.Tensor)
                             and not comm.is_host_marked(args[0]) and _to_host(args, kwargs)):
            self.rec.sync("device-to-host copy")
        return func(*args, **kwargs)

    def _sdpa(self, func, args, kwargs):
        names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
        a = dict(zip(names, args)) | kwargs
        q, k, v = a["query"], a["key"], a["value"]
        dtype = torch.get_autocast_dtype(q.device.type) if torch.is_autocast_enabled(q.device.type) else q.dtype
        mask = a.get("attn_mask")
        kernel, reasons = sdpa_kernel(q.to(dtype) if dtype != q.dtype else q, k, v, mask, a.get("dropout_p", 0.0),
                                      a.get("is_causal", False), a.get("enable_gqa", False))
        here = where()
        self.rec.attention[kernel] += 1
        if mask is not None and mask.dim() >= 2 and mask.shape[-2] == q.shape[-2] and mask.shape[-1] == k.shape[-2] \
                and q.shape[-2] > MASKED_QUERY_TILE:
            self.rec.error(f"dense [S, S] attention mask {list(mask.shape)} ({mask.dtype}) at {here}: "
                           f"{mask.numel() * mask.element_size()} bytes per call; use a per-document kernel")
        if kernel == "math":
            self.rec.error(f"math attention kernel at {here} (q {list(q.shape)} {dtype}, kv heads {k.shape[-3]}, "
                           f"mask {'yes' if mask is not None else 'no'}): {'; '.join(reasons)}")
        with self.rec.kernel_named():
            return func(*args, **kwargs)


class GpuRecorder(TorchDispatchMode):
    """Entered inside a ``FakeTensorMode`` (so it sees every op first); see the module doc.
    ``layer_modules``: the model's layer modules (and their children): a sync while one of
    them is on the stack, or in a meshfold autograd ``backward``, is *inside a layer*."""

    def __init__(self, dims=None, layer_modules=()):
        super().__init__()
        self.groups = _group_dims(dims)
        self.layer_ids = {id(m) for m in layer_modules}
        self.syncs: Counter = Counter()
        self.in_layer: set[str] = set()
        self.attention: Counter = Counter()
        self.gemms: Counter = Counter()  # input dtype name -> matrix multiplies
        self.wire: dict[str, set] = defaultdict(set)
        self.wire_places: dict[str, str] = {}  # "dim dtype" -> "op from place" of the first such call
        self.wire_sources: dict[str, set] = defaultdict(set)  # "dim dtype" -> every "op from place"
        self.block_ids: set[int] = set()
        self.block_inputs: Counter = Counter()  # dtype of the residual stream entering each block call
        self.errors: list[str] = []
        self._comm_depth = 0
        self._naming = 0
        self._tolist = None

    def attach(self, dims, layer_modules=(), blocks=()) -> None:
        """Once the rank is built: its mesh's groups, layers and transformer blocks; what
        building did is not a step."""
        self.groups, self.layer_ids = _group_dims(dims), {id(m) for m in layer_modules}
        self.block_ids = {id(m) for m in blocks}
        self.pop_step()
        self.in_layer, self.wire, self.wire_places = set(), defaultdict(set), {}
        self.wire_sources, self.block_inputs = defaultdict(set), Counter()

    def block_called(self, module, args) -> None:
        """A transformer block's forward: the dtype its input (the residual stream) has."""
        if id(module) in self.block_ids:
            x = next((a for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()), None)
            if x is not None:
                self.block_inputs[_dtype_name(x.dtype)] += 1

    # -- bookkeeping

    def error(self, text: str) -> None:
        if text not in self.errors:
            self.errors.append(text)

    @contextlib.contextmanager
    def kernel_named(self):
        self._naming += 1
        try:
            yield
        finally:
            self._naming -= 1

    def stepping(self, step):
        """``step`` run as the trainer runs it: host marks on (``comm.HostTensorMode``)."""
        def run(*args, **kwargs):
            with comm.HostTensorMode():
                return step(*args, **kwargs)
        return run

    def pop_step(self) -> dict:
        """This step's syncs ({where: count}) and attention calls; then a new step."""
        out = {"syncs": dict(self.syncs), "attention": dict(self.attention), "gemms": dict(self.gemms)}
        self.syncs, self.attention, self.gemms = Counter(), Counter(), Counter()
        return out

    def sync(self, what: str) -> None:
        frame = sys._getframe(1)
        # one .tolist() reads every element (FakeTensor.tolist: one item() each): count it once
        tolist = _enclosing(frame, "tolist")
        if tolist is not None:
            if tolist is self._tolist:
                return
            self._tolist, what = tolist, "tolist"
        place = f"{where()} ({what})"
        self.syncs[place] += 1
        if self._inside_layer(frame):
            self.in_layer.add(place)

    def _inside_layer(self, frame) -> bool:
        innermost_backward = None
        while frame is not None:
            owner = frame.f_locals.get("self")
            if owner is not None and id(owner) in self.layer_ids:
                return True
            path = frame.f_code.co_filename
            if innermost_backward is None and path.startswith(_PKG) and path != _SELF:
                innermost_backward = frame.f_code.co_name == "backward" and (
                    f"{os.sep}models{os.sep}" in path or f"{os.sep}parallel{os.sep}" in path)
            frame = frame.f_back
        return bool(innermost_backward)

    # -- communication (comm.py's observer: meshfold names the dimension)

    def host_in_collective(self, what: str, t: torch.Tensor) -> None:
        self.error(f"host tensor {t.dtype}{list(t.shape)} in {what} from {where(skip_comm=True)}: NCCL needs "
                   "device tensors")

    @contextlib.contextmanager
    def comm_call(self, op: str, tensors, group, dim):
        for dtype in _packed_dtypes(tensors[0].dtype) if dim is not None and tensors else ():
            self._wire(dim, dtype, op)
        if threading.current_thread() is not threading.main_thread():
            # NCCL runs each rank's collectives (over all its communicators) in issue order:
            # a second issuing thread can order them differently on two ranks and deadlock
            self.error(f"{op} on {dim} issued from thread {threading.current_thread().name!r} at "
                       f"{where(skip_comm=True)}: collectives must be issued in the step's order")
        self._comm_depth += 1
        try:
            yield
        finally:
            self._comm_depth -= 1

    # -- every op

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.__name__.split(".")[0]
        ns = func.namespace
        if ns in ("c10d", "_c10d_functional", "c10d_functional"):
            self._collective(name, args, kwargs)
        elif ns == "aten":
            handled, out = self._aten(func, name, args, kwargs)
            if handled:
                return out
        return func(*args, **kwargs)

    def _aten(self, func, name, args, kwargs):
        if name in _GEMMS:
            a = args[1] if name in ("addmm", "baddbmm") else args[0]
            self.gemms[_dtype_name(_stored_dtype(a))] += 1
            self._fp8_gemm(name, [t for t in args[:3] if isinstance(t, torch.Tensor)])
        if name == "_scaled_dot_product_flash_attention_for_cpu" and not self._naming:
            q = args[0]
            masked = kwargs.get("attn_mask") is not None or (len(args) > 5 and args[5] is not None)
            dtype = q.dtype
            kernel = _cuda_kind(dtype, masked)
            self.attention[kernel] += 1
            if kernel == "math":
                self.error(f"math attention kernel at {where()} ({dtype} block: no fused CUDA kernel)")
        if name == "_flash_attention_forward":  # packed documents' varlen kernel (models/attention_ops.py)
            windowed = kwargs.get("window_size_left") is not None  # sliding-window layers: flash's own window
            self.attention["flash-window" if windowed else "flash-varlen"] += 1
        x = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if not isinstance(x, FakeTensor) or comm.is_host_marked(x) or x.constant is not None:
            return False, None  # real values (the mesh's rank tables, fake copies of them): not device data
        if name == "_local_scalar_dense":
            self.sync("scalar read")
            if x.dtype == torch.bool:
                return True, True
            return True, (1.0 if x.dtype.is_floating_point else 1)
        if name in ("is_nonzero", "equal", "allclose"):
            self.sync(name)
            return True, True
        if name in ("nonzero", "argwhere"):
            self.sync(name)
            return True, x.new_empty((x.numel(), x.dim()), dtype=torch.int64)
        if name == "masked_select":
            self.sync(name)
            return True, x.new_empty((max(x.numel(), args[1].numel()),))
        if name in ("unique", "_unique", "_unique2", "unique_dim", "unique_consecutive"):
            self.sync("unique")
            values = x.new_empty((1,))
            extra = (x.new_zeros(x.shape, dtype=torch.int64), x.new_ones((1,), dtype=torch.int64))
            return True, (values, extra[0]) if name == "_unique" else (values, *extra)
        if name == "bincount":
            self.sync("bincount")
            minlength = kwargs.get("minlength", args[2] if len(args) > 2 else 0)
            weights = kwargs.get("weights", args[1] if len(args) > 1 else None)
            return True, x.new_zeros((max(int(minlength), 1),),
                                     dtype=torch.int64 if weights is None else torch.float64)
        if func is _aten.repeat_interleave.Tensor and kwargs.get("output_size") is None:
            self.sync("repeat_interleave without output_size")
            return True, x.new_zeros((x.numel(),), dtype=torch.int64)
        if name in ("index", "_index_put_impl_", "index_put_", "index_put"):
            indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
            if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (indices or ())):
                self.sync("boolean-mask indexing")
                fixed = []
                for i in indices:
                    if isinstance(i, torch.Tensor) and i.dtype == torch.bool:
                        fixed += [i.new_zeros((i.numel(),), dtype=torch.int64)] * i.dim()
                    else:
                        fixed.append(i)
                return True, func(args[0], fixed, *args[2:], **kwargs)
        return False, None

    def _fp8_gemm(self, name: str, operands: list) -> None:
        """One-line refusals of an fp8 GEMM this device cannot run."""
        fp8 = [t for t in operands if _stored_dtype(t) != t.dtype]
        if not fp8:
            return
        kind = "mx" if any(getattr(t, "qdata", None) is not None for t in fp8) else "float8"
        need = FP8_CAPABILITY[kind]
        if CAPABILITY < need:
            self.error(f"{kind} GEMMs need compute capability sm{need[0]}{need[1]}; the device is "
                       f"sm{CAPABILITY[0]}{CAPABILITY[1]} (train.fp8: MXFP8 on Blackwell, the others from Ada/Hopper)")
        dims = sorted({d for t in fp8 for d in t.shape[-2:] if d % 16})
        if dims:
            self.error(f"{kind} GEMM ({name}) at {where()} with dimensions {dims} not a multiple of 16: "
                       "the fp8 kernels refuse it (keep that linear in bf16)")

    def _collective(self, name, args, kwargs) -> None:
        tensors = list(_tensors(args, kwargs))
        for t in tensors:
            if comm.is_host_marked(t):
                self.error(f"host tensor {t.dtype}{list(t.shape)} in torch's {name} at {where()}: NCCL needs "
                           "device tensors")
        if self._comm_depth or not tensors or name in ("wait_tensor", "barrier", "monitored_barrier"):
            return
        group = next((g for g in map(_process_group, list(args) + list(kwargs.values())) if g is not None), None)
        if group is not None:
            dim = self.groups.get(_group_key(group), _group_desc(group))
        else:  # functional collectives name their group
            dim = self.groups.get(next((a for a in args if isinstance(a, str)), ""), "?")
        payload = tensors[-1] if name.startswith(("_allgather", "allgather", "all_gather")) else tensors[0]
        if payload.numel() > 1:  # control scalars are not traffic
            for dtype in _packed_dtypes(payload.dtype):
                self._wire(dim, dtype, name.strip("_"))

    def _wire(self, dim: str, dtype: torch.dtype, op: str) -> None:
        name = _dtype_name(dtype)
        self.wire[dim].add(name)
        place = f"{op} from {where(skip_comm=True)}"
        self.wire_places.setdefault(f"{dim} {name}", place)
        self.wire_sources[f"{dim} {name}"].add(place)

    def report(self) -> dict:
        return {"wire_dtypes": {d: sorted(v) for d, v in sorted(self.wire.items())}, "wire_places": self.wire_places,
                "wire_sources": {k: sorted(v) for k, v in sorted(self.wire_sources.items())},
                "errors": list(self.errors), "in_layer": sorted(self.in_layer),
                "block_inputs": dict(sorted(self.block_inputs.items()))}


def _to_host(args, kwargs) -> bool:
    target = kwargs.get("device", next((a for a in args[1:] if isinstance(a, (str, torch.device))), None))
    return target == "cpu" or (isinstance(target, str) and target.startswith("cpu"))


def _enclosing(frame, name: str):
    """The outermost FakeTensor ``name`` frame near ``frame`` (a 2-d ``tolist`` recurses per row)."""
    found, depth = None, 0
    while frame is not None and depth < 16:
        if frame.f_code.co_name == name and frame.f_code.co_filename.endswith("fake_tensor.py"):
            found = frame
        frame, depth = frame.f_back, depth + 1
    return found


def _stored_dtype(t: torch.Tensor) -> torch.dtype:
    """The dtype a tensor's data is stored in: an fp8 training tensor's (torchao keeps it in
    ``_data``, an MX tensor in ``qdata``) rather than the high-precision dtype it stands for."""
    inner = getattr(t, "_data", None)
    if inner is None:
        inner = getattr(t, "qdata", None)
    return inner.dtype if isinstance(inner, torch.Tensor) else t.dtype


def _packed_dtypes(dtype: torch.dtype) -> list[torch.dtype]:
    """A payload's dtypes: FSDP2's uint8 gather buffer (``foreach_all_gather`` packs fp8 weights
    beside bf16 norms under ``train.fp8_all_gather``) by what it packs, others by their own."""
    frame = sys._getframe(1) if dtype == torch.uint8 else None
    while frame is not None and frame.f_code.co_name != "foreach_all_gather":
        frame = frame.f_back
    packed = frame.f_locals.get("param_all_gather_input_dtypes") if frame is not None else None
    return sorted({d for ds in packed for d in ds}, key=str) if packed else [dtype]


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _tensors(args, kwargs):
    for a in list(args) + list(kwargs.values()):
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, (list, tuple)):
            for b in a:
                if isinstance(b, torch.Tensor):
                    yield b


def _process_group(a):
    """The ProcessGroup a c10d op was given (boxed as a ScriptObject at the dispatcher)."""
    pg = torch._C._distributed_c10d.ProcessGroup
    if isinstance(a, pg):
        return a
    if isinstance(a, torch.ScriptObject):
        with contextlib.suppress(Exception):
            return pg.unbox(a)
    return None


def _group_key(group) -> str:
    try:
        return group.group_name
    except Exception:  # noqa: BLE001 - a group without a name
        return str(id(group))


def _group_desc(group) -> str:
    desc = getattr(group, "group_desc", "") or ""
    return desc[5:] if desc.startswith("mesh_") else (desc or "?")


def _group_dims(dims) -> dict:
    """group name -> mesh dimension name, for the groups of ``dims`` (flattened views too)."""
    out = {}
    if dims is None or getattr(dims, "mesh", None) is None:
        return out
    names = list(dims.mesh.mesh_dim_names or ()) + list(dims.flat)
    for name in names:
        with contextlib.suppress(Exception):
            if dims.size(name) > 1:
                out[_group_key(dims.group(name))] = name
    return out


@contextlib.contextmanager
def recording(dims=None, layer_modules=()):
    """Record GPU behaviour (enter inside the FakeTensorMode); steps run under ``step()``."""
    global _EMULATING
    rec = GpuRecorder(dims, layer_modules)
    comm.set_observer(rec)
    _EMULATING = True
    hook = register_module_forward_pre_hook(lambda module, args: rec.block_called(module, args))
    try:
        with rec, _Functions(rec):
            yield rec
    finally:
        hook.remove()
        _EMULATING = False
        comm.set_observer(None)


_EMULATING = False


def on_cuda(t: torch.Tensor) -> bool:
    """Whether ``t``'s computation runs on CUDA: its device, or this recorder's run (host fake
    tensors recorded as a CUDA run), so device-dependent choices are the ones a GPU makes."""
    return t.is_cuda or _EMULATING


def layer_modules(parts) -> list:
    """Every module of the model's layers (``layers.<i>`` and below) in ``parts``."""
    out = []
    for part in parts:
        for name, m in part.named_modules():
            if ".layers." in f".{name}" or name.startswith("layers."):
                out.append(m)
    return out


def blocks(parts) -> list:
    """The transformer blocks (``layers.<i>``) in ``parts``, in order."""
    layers = (getattr(getattr(part, "module", part), "layers", None) for part in parts)  # (DDP: .module)
    return [m for group in layers if group is not None for m in group.values()]


def extrapolate(c1: dict, c2: dict, k: float) -> dict:
    """Counts of a step of m micro-batches from steps of ``unit`` and ``2 unit`` (affine in m)."""
    return {key: int(round(c1.get(key, 0) + k * (c2.get(key, 0) - c1.get(key, 0))))
            for key in sorted(set(c1) | set(c2))}


def summary(per_rank: dict) -> dict:
    """The report's ``gpu`` object from each simulated rank's ``gpu`` (rank 0's syncs)."""
    first = per_rank[min(per_rank)]
    wire, attention, errors = defaultdict(set), Counter(), []
    for rank, g in sorted(per_rank.items()):
        for d, v in g["wire_dtypes"].items():
            wire[d] |= set(v)
        attention.update(g["attention"])
        errors += [e if len(per_rank) == 1 else f"rank {rank}: {e}" for e in g["errors"]]
    syncs = first["syncs"]
    gemms = Counter(first.get("gemms", {}))
    blocks_in = Counter()
    for g in per_rank.values():
        blocks_in.update(g.get("block_inputs", {}))
    return {"host_syncs_per_step": int(sum(syncs.values())),
            "block_inputs": dict(sorted(blocks_in.items())),
            "host_syncs": [{"where": w, "count": c} for w, c in sorted(syncs.items(), key=lambda x: -x[1])],
            "attention": dict(sorted(attention.items())),
            "gemms": dict(sorted(gemms.items())),  # rank 0's, per step
            "wire_dtypes": {d: sorted(v) for d, v in sorted(wire.items())},
            "errors": errors}

