"""The routed experts' computation, free of parallelism: ``GroupedExperts`` (the experts'
stacked weights [E, out, in] and their grouped GEMM or padded batched matmul over the rows
each expert received) and the pieces it needs (groups of rows, the kernel choice, row moves,
the routing counts read the fake-tensor-safe way: ``models/moe.py``'s docstring). The MoE
block (``models/moe.py``) routes rows to it; expert parallel shards its weights.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn
from torch._guards import detect_fake_mode


def has_values(t: torch.Tensor) -> bool:
    """False for a tensor that carries shapes but no data (under a ``FakeTensorMode``, as
    ``meshfold dry-run`` runs the step): its routing cannot be read. While ``torch.compile``
    traces (with fake tensors too) the answer is True: the compiled code must read the real
    routing, so the count and the host read stay what they were (a graph break)."""
    return torch.compiler.is_compiling() or detect_fake_mode(t) is None


def count_rows(key: torch.Tensor, n: int, balanced=None) -> torch.Tensor:
    """Rows per key value in [0, n) (``bincount(key, minlength=n)``), on the device without a
    host read: a scatter-add into n counters (CUDA's ``bincount`` reads the key's maximum on
    the host). The same op with or without values (``balanced`` is kept for the callers' form:
    the counts only reach the host through ``read_counts``, which answers for fake tensors)."""
    return torch.zeros(n, dtype=torch.int64, device=key.device).scatter_add_(
        0, key.reshape(-1), torch.ones(key.numel(), dtype=torch.int64, device=key.device))


def read_counts(t: torch.Tensor, balanced):
    """``t.tolist()``: a routing count read on the host; for a tensor without values,
    ``balanced()`` (what a balanced router gives there). Without values the read is still
    asked for (and its failure ignored), so ``meshfold dry-run --device cuda``, which answers
    reads, counts it where the real run has it."""
    if has_values(t):
        return t.tolist()
    with contextlib.suppress(Exception):
        t.tolist()
    return balanced()


class _ScatterRows(torch.autograd.Function):
    """``zeros(rows, ...).index_copy(0, dest, x)`` (into the padded layout) keeping only ``dest``
    for backward: autograd's own ``index_copy`` keeps the whole source alive until backward,
    only to read its shape (a T k x dim copy of the expert input per MoE layer and micro-batch)."""

    @staticmethod
    def forward(ctx, x, dest, rows):
        ctx.save_for_backward(dest)
        return x.new_zeros((rows,) + tuple(x.shape[1:])).index_copy_(0, dest, x)

    @staticmethod
    def backward(ctx, grad):
        (dest,) = ctx.saved_tensors
        return grad.index_select(0, dest), None, None


class _GatherRows(torch.autograd.Function):
    """``x[index]`` (rows, indices may repeat) whose backward is one ``index_add`` into the
    [rows of x, dim] gradient (autograd's own backward of indexing is a slower accumulating
    ``index_put``)."""

    @staticmethod
    def forward(ctx, x, index):
        ctx.save_for_backward(index)
        ctx.rows = x.shape[0]
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx, grad):
        (index,) = ctx.saved_tensors
        out = grad.new_zeros((ctx.rows,) + tuple(grad.shape[1:]))
        return out.index_add_(0, index, grad), None


def gather_rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return _GatherRows.apply(x, index)


def scatter_add_rows(x: torch.Tensor, token: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """out[t] = sum of the rows y[i] with token[i] = t (gates already applied), summed in
    >= fp32 (expert outputs are bf16 under autocast), returned in y's dtype."""
    acc = torch.promote_types(y.dtype, torch.float32)
    out = torch.zeros(x.shape, dtype=acc, device=x.device)
    return out.index_add(0, token, y.to(acc)).to(y.dtype)


class _ScaleGrad(torch.autograd.Function):
    """Identity forward, gradient times ``scale`` backward."""

    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


def _local(t: torch.Tensor, grad_scale: float = 1.0) -> torch.Tensor:
    """A DTensor's local shard (expert parallel shards expert weights as DTensors)."""
    t = t.to_local() if hasattr(t, "to_local") else t
    return t if grad_scale == 1.0 else _ScaleGrad.apply(t, grad_scale)


# The public form (torch.nn.functional.grouped_mm, torch >= 2.9) where it exists.
_GROUPED_MM = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def grouped_gemm_supported(x: torch.Tensor) -> bool:
    """``torch._grouped_mm`` runs here: CPU fp32/bf16/fp16, CUDA bf16 on sm90+ (torch 2.13)."""
    if _GROUPED_MM is None:
        return False
    if not has_values(x):  # torch's shape function for it takes bf16 only (torch 2.13)
        return x.dtype == torch.bfloat16
    if x.device.type == "cpu":
        return x.dtype in (torch.float32, torch.bfloat16, torch.float16)
    if x.device.type == "cuda":
        return x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device) >= (9, 0)
    return False


def expert_kernel(x: torch.Tensor, choice: str = "auto") -> str:
    """"grouped_mm" (one grouped GEMM, no host read) where the device has it, else
    "padded_bmm" (a batched matmul over experts padded to the largest group: float64
    references, GPUs before sm90; one host read of that size)."""
    if choice != "auto":
        return choice
    return "grouped_mm" if grouped_gemm_supported(x) else "padded_bmm"


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The autocast dtype if autocast is on (grouped GEMM is not on autocast's list)."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


# Rows per grouped-GEMM group are padded to a multiple of this many bytes' worth of rows
# (sm90's grouped GEMM wants 16-byte aligned groups: 8 rows of bf16). CUDA only: the CPU
# kernel (a loop of matmuls) takes any group, and the copies into and out of the padded
# layout cost a fifth of a 64-expert MoE block's step there (docs/moe.md).
GROUP_ALIGN_BYTES = 16


def group_align(x: torch.Tensor) -> int:
    """Rows per grouped-GEMM group multiple on ``x``'s device (1 = no padding)."""
    return max(1, GROUP_ALIGN_BYTES // x.element_size()) if x.device.type == "cuda" else 1


class _Groups:
    """How rows map onto the kernel: offsets for the grouped GEMM (rows sorted by expert), or
    the (expert, slot) of every row in the padded [E, cap, .] layout (any row order).

    Grouped GEMM: each expert's group is padded to a multiple of ``align`` rows (16 bytes of
    the compute dtype), with no host read: the padded layout has a fixed size (rows plus
    ``(align - 1) E``), row i of expert e goes to ``dest[i]`` = its padded group's start plus
    its place in the group, and rows past the last offset are never read back."""

    def __init__(self, counts: torch.Tensor, rows: int, kernel: str, expert: torch.Tensor | None = None,
                 align: int = 1, whole: bool = False):
        """``whole``: the padded layout's row count a multiple of ``align`` too (a recipe's
        grouped GEMM that scales blocks of rows reads them all)."""
        self.kernel = kernel
        if kernel == "grouped_mm":
            self.dest = None
            if align > 1 and rows:
                E = counts.shape[0]
                padded = (counts + (align - 1)) // align * align
                start, pstart = torch.cumsum(counts, 0) - counts, torch.cumsum(padded, 0) - padded
                owner = torch.repeat_interleave(torch.arange(E, device=counts.device), counts, output_size=rows)
                self.dest = torch.arange(rows, device=counts.device) - start[owner] + pstart[owner]
                self.padded_rows = rows + (align - 1) * E
                if whole:
                    self.padded_rows = -(-self.padded_rows // align) * align
                self.offsets = torch.cumsum(padded, 0).to(torch.int32)
            else:
                self.offsets = torch.cumsum(counts, 0).to(torch.int32)
            return
        E = counts.shape[0]
        # the padded path's one host read (balanced: ceil(rows / E))
        self.E, self.cap = E, (int(read_counts(counts.max(), lambda: -(-rows // E))) if rows else 0)
        if expert is None:  # rows sorted by expert
            start = torch.cumsum(counts, 0) - counts
            self.expert = torch.repeat_interleave(torch.arange(E, device=counts.device), counts, output_size=rows)
            self.slot = torch.arange(rows, device=counts.device) - start[self.expert]
        else:  # unsorted: a row's slot is the number of earlier rows of its expert (no sort)
            self.expert = expert
            self.slot = (F.one_hot(expert, E).cumsum(0) - 1).gather(1, expert[:, None]).squeeze(1)

    def row_experts(self, rows: int, device) -> torch.Tensor:
        """[rows] the expert of each row of the kernel's layout (for the experts' biases):
        grouped GEMM by its offsets, E for the rows past the last one (the kernel leaves them
        unwritten, forward and backward: they must reach no expert's bias gradient), the
        padded and capacity layouts by their expert of each row."""
        if self.kernel == "grouped_mm":
            return torch.searchsorted(self.offsets, torch.arange(rows, device=device, dtype=torch.int32), right=True)
        if self.kernel == "bmm":
            return torch.arange(self.E, device=device).repeat_interleave(self.cap)
        return self.expert


def fixed_groups(n_experts: int, per: int) -> _Groups:
    """Capacity mode's layout: ``per`` rows for each expert, expert-major ([E * per] rows, the
    empty slots zero rows): one batched matmul over [E, per, .], no offsets, no host read."""
    groups = _Groups.__new__(_Groups)
    groups.kernel, groups.dest, groups.E, groups.cap = "bmm", None, n_experts, per
    return groups


def grouped_linear(x: torch.Tensor, w: torch.Tensor, groups: _Groups, gemm=None) -> torch.Tensor:
    """Rows of x [N, in] grouped by expert times their expert's weight w [E, out, in]^T -> [N, out]
    (grouped GEMM with aligned groups: x and the result are in the padded layout). ``gemm``:
    a grouped GEMM ``(x, w_t, offs=)`` in place of torch's (``GroupedExperts.grouped_mm``)."""
    if groups.kernel == "bmm":
        return torch.bmm(x.view(groups.E, groups.cap, -1), w.transpose(-2, -1)).view(groups.E * groups.cap, -1)
    if groups.kernel == "grouped_mm":
        return (gemm or _GROUPED_MM)(x, w.transpose(-2, -1), offs=groups.offsets)
    padded = x.new_zeros(groups.E, groups.cap, x.shape[1]).index_put((groups.expert, groups.slot), x)
    return torch.bmm(padded, w.transpose(-2, -1))[groups.expert, groups.slot]


class GroupedExperts(nn.Module):
    """E expert MLPs stored as stacked weights [E, out, in], run as grouped GEMMs on tokens
    already sorted by expert. Under expert parallel each rank holds a slice of the experts.

    SwiGLU experts keep w1 and w3 as one parameter ``w13`` [E, 2 hidden, dim] (w1's rows,
    then w3's: transformers' fused ``gate_up_proj`` layout), so their first GEMM runs on it
    directly: no concatenated copy of the expert weights per forward. GELU experts: ``w1``.
    Any other gated kind (a family's ``registry.mlps``) has ``w13`` and its own ``glu(gate,
    up)`` in place of silu(gate) * up. ``bias``: per-expert biases ``w13_bias`` (or
    ``w1_bias``) [E, out] and ``w2_bias`` [E, dim] (gpt-oss)."""

    def __init__(self, n_experts: int, dim: int, hidden: int, kind: str = "swiglu", bias: bool = False,
                 glu=None):
        super().__init__()
        self.kind = kind
        self.glu = glu
        w_in = "w13" if kind != "gelu" else "w1"
        setattr(self, w_in, nn.Parameter(torch.empty(n_experts, (1 + (kind != "gelu")) * hidden, dim)))
        self.w2 = nn.Parameter(torch.empty(n_experts, dim, hidden))
        if bias:
            setattr(self, w_in + "_bias", nn.Parameter(torch.zeros(n_experts, getattr(self, w_in).shape[1])))
            self.w2_bias = nn.Parameter(torch.zeros(n_experts, dim))
        self.biased = bias
        # Expert parallel sets this: an expert's gradient gathers tokens from ep ranks at once.
        self.grad_scale = 1.0
        self.kernel = "auto"  # or "grouped_mm" / "padded_bmm" (see expert_kernel)
        # A precision recipe's grouped GEMM ``(x, w_t, offs=) -> y`` in place of torch's, and the
        # rows its groups must be a multiple of (set by ``parallel/fp8/experts.py``: MXFP8 scales
        # blocks of 32 rows in the weight gradient). The padded kernels ignore both.
        self.grouped_mm = None
        self.group_rows = 1

    def forward(self, x, counts: torch.Tensor | None = None, groups: _Groups | None = None,
                gates: torch.Tensor | None = None, sends: list[torch.Tensor] | None = None):
        """x: [sum(counts), dim], rows grouped by (local) expert; counts: [E] rows per expert,
        a device tensor (``groups``: a precomputed layout, then rows may be in any order).
        ``gates`` [rows]: each row's gate, applied to the hidden activation before the second
        GEMM when it is the narrower (g * (h W2^T) = (g * h) W2^T; fine-grained experts), else
        to the output. Every expert's
        weights join the graph, so each gets a (possibly zero) gradient on every rank.

        ``x`` may instead be a callable ``feed(run, sends)`` that calls ``run(rows, counts,
        groups, gates)`` once per chunk of rows, as each becomes available, and returns what
        it builds from the results (expert parallel's overlapped exchange): one forward call
        for all chunks, so a wrapper (FSDP) gathers the weights once. ``sends``, the tensors
        the feed starts from, pass through the call so a wrapper sees them as its inputs
        (FSDP hooks its gradient reduce-scatter onto theirs). The rows are computed in the
        autocast dtype, else the weights' (a wrapper's compute dtype)."""
        w_in = self.w13 if self.kind != "gelu" else self.w1
        if callable(x):
            device = w_in.device.type
            dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else w_in.dtype
            w1, w2 = (_local(w, self.grad_scale).to(dtype) for w in (w_in, self.w2))
            biases = self._biases(dtype)
            return x(lambda rows, counts, groups=None, gates=None:
                     self._grouped(rows.to(dtype), w1, w2, counts, groups, gates, biases), sends)
        dtype = _compute_dtype(x)
        w1, w2 = (_local(w, self.grad_scale).to(dtype) for w in (w_in, self.w2))
        return self._grouped(x.to(dtype), w1, w2, counts, groups, gates, self._biases(dtype))

    def _biases(self, dtype) -> tuple | None:
        """(first GEMM's, second GEMM's) biases, local and in the compute dtype, or None."""
        if not self.biased:
            return None
        b_in = self.w13_bias if self.kind != "gelu" else self.w1_bias
        return tuple(_local(b, self.grad_scale).to(dtype) for b in (b_in, self.w2_bias))

    def _grouped(self, x, w1, w2, counts, groups, gates, biases=None):
        if groups is None:
            kernel = expert_kernel(x, self.kernel)
            groups = _Groups(counts, x.shape[0], kernel, align=max(self.group_rows, group_align(x)),
                             whole=self.group_rows > 1)
        if getattr(groups, "dest", None) is not None:  # aligned groups: in and out of the padded layout once
            x = _ScatterRows.apply(x, groups.dest, groups.padded_rows)
            if gates is not None:
                gates = _ScatterRows.apply(gates, groups.dest, groups.padded_rows)
            return self._run(x, w1, w2, groups, gates, biases).index_select(0, groups.dest)
        return self._run(x, w1, w2, groups, gates, biases)

    def _run(self, x, w1, w2, groups, gates, biases=None):
        """``w1``: the first GEMM's weight (gated kinds: w13, twice the columns per expert)."""
        gemm = self.grouped_mm
        h = grouped_linear(x, w1, groups, gemm)
        if biases is not None:  # (a zero row E for the rows no expert owns: row_experts)
            rows = groups.row_experts(h.shape[0], h.device)
            biases = [F.pad(b, (0, 0, 0, 1)) for b in biases]
            h = h + biases[0].index_select(0, rows)
        if self.kind == "gelu":
            h = F.gelu(h, approximate="tanh")
        else:
            h1, h3 = h.chunk(2, dim=-1)
            h = F.silu(h1) * h3 if self.glu is None else self.glu(h1, h3)
        if biases is not None:  # the gate scales the biased output (it cannot move before w2)
            y = grouped_linear(h, w2, groups, gemm) + biases[1].index_select(0, rows)
            return y if gates is None else y * gates[:, None].to(y.dtype)
        if gates is None:
            return grouped_linear(h, w2, groups, gemm)
        if h.shape[1] <= w2.shape[1]:  # the narrower side takes the [rows, width] product
            return grouped_linear(h * gates[:, None].to(h.dtype), w2, groups, gemm)
        return grouped_linear(h, w2, groups, gemm) * gates[:, None].to(h.dtype)
