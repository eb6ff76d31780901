"""ZeRO-1 as Megatron-LM's distributed optimizer (``ShardedAdamW``): Adam state for one
flat segment of this rank's parameter pieces, one all-gather of the updated segments,
bf16 compute weights gathered straight from it; checkpointed as the boxes its segment
cuts the parameters into (``zero_state.py``), which any layout reads back."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from meshfold import comm
from meshfold.optim.state import (
    ADAM_KEYS,
    CheckpointStateError,
    ParamNames,
    load_param_groups,
    param_group_entries,
)
from meshfold.optim.zero_state import Piece, chunks_of, sharded_layout


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _held(t: torch.Tensor) -> torch.Tensor:
    """The tensor that owns a (DTensor) parameter's local storage (``to_local`` may return
    a view of it)."""
    return t._local_tensor if isinstance(t, DTensor) else t


class ShardedAdamW(torch.optim.Optimizer):
    """ZeRO-1 as Megatron-LM's distributed optimizer. Gradients arrive already averaged
    (DDP or ``GradReducer``, once per step). This rank's local parameter pieces, laid end
    to end, form one flat range of ``total`` elements cut into n equal segments (element
    granularity, so no rank holds more than ceil(total/n) elements of Adam state however
    uneven the parameters are); rank r keeps Adam state for segment r only, updates it, and
    one all-gather of the segments hands every rank the updated values.

    fp32 compute (``compute_dtype`` None): the state's parameters are views into the
    parameters, and the all-gather writes the updated fp32 values back into them.

    bf16 compute (``compute_dtype``, ``parallel/compute_weights.py``), as Megatron: the rank
    keeps fp32 master values only for its segment (``master_shard``, which Adam updates);
    the all-gather carries the updated segments in bf16, into one flat buffer whose views
    are the next step's compute weights (``compute_copies``): half the bytes of fp32 on the
    wire, no cast per step. The module's fp32 parameters then hold no values between steps
    (``release``: their storage is freed, 4 B per parameter; shapes, gradients and autograd
    are untouched); ``sync_masters`` gathers the fp32 values into them where they are read
    whole (checkpoint save, ``full_state``; collective over the group), ``materialize``
    gives them storage to be loaded into, and ``masters_written`` takes loaded values back
    into the shard and the buffer.

    ``param_groups`` still list every parameter, with every key AdamW's groups have (so
    schedulers work, and a checkpoint's param groups load into any layout's optimizer).
    ``pieces``/``_views`` and the inner optimizer's state are what checkpoints save
    (``checkpoint_state``)."""

    def __init__(self, groups: list[dict], group: dist.ProcessGroup, compute_dtype: torch.dtype | None = None,
                 **adam_kwargs):
        adamw_defaults = torch.optim.AdamW([torch.empty(0, requires_grad=True)], **adam_kwargs).defaults
        super().__init__(groups, dict(adamw_defaults, weight_decay=0.0))
        self.group = group
        self.n, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.params = [p for g in self.param_groups for p in g["params"]]
        dtypes = {_local(p).dtype for p in self.params}
        if len(dtypes) > 1:
            raise ValueError(f"ZeRO-1 with tensor/pipeline parallel needs one parameter dtype, got {dtypes}")
        self.dtype = dtypes.pop() if dtypes else torch.float32
        self.device = _local(self.params[0]).device if self.params else torch.device("cpu")
        self.compute_dtype = compute_dtype if compute_dtype not in (None, self.dtype) else None
        total = sum(_local(p).numel() for p in self.params)
        self.segment = max(1, math.ceil(total / self.n))
        lo, hi = self.rank * self.segment, (self.rank + 1) * self.segment
        # (param, start, stop) of the pieces this rank updates, in flat order; per group.
        self.pieces: list[tuple[torch.Tensor, int, int]] = []
        owned: list[list[tuple[torch.Tensor, int, int]]] = []
        offset = 0
        for g in self.param_groups:
            owned.append([])
            for p in g["params"]:
                numel = _local(p).numel()
                a, b = max(lo, offset) - offset, min(hi, offset + numel) - offset
                if a < b:
                    self.pieces.append((p, a, b))
                    owned[-1].append((p, a, b))
                offset += numel
        # Adam's parameters: views into the parameters (fp32 compute) or into the rank's own
        # fp32 master shard (bf16 compute), piece after piece
        self.master_shard = None
        if self.compute_dtype is not None:
            self.master_shard = torch.zeros(sum(b - a for _, a, b in self.pieces), dtype=self.dtype,
                                            device=self.device)
        inner_groups, at = [], 0
        for g, pieces in zip(self.param_groups, owned):
            views = []
            for p, a, b in pieces:
                if self.master_shard is None:
                    views.append(_local(p).detach().view(-1)[a:b])
                else:
                    views.append(self.master_shard[at: at + b - a])
                    at += b - a
            if views:
                inner_groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": views})
        self._views = [v for g in inner_groups for v in g["params"]]
        self._inner_of = [i for i, g in enumerate(owned) if g]
        self.optim = torch.optim.AdamW(inner_groups, **adam_kwargs) if inner_groups else None
        self.current = True  # the module's fp32 parameters hold the current values
        self._released: list[torch.Tensor] = []  # local parameter tensors whose storage is freed
        self._boxes: list[Piece] | None = None  # the pieces as checkpoint boxes, once asked for
        if self.compute_dtype is not None:
            self._init_compute_buffer()

    # ------------------------------------------------------------------ bf16 compute buffer

    @torch.no_grad()
    def _init_compute_buffer(self) -> None:
        """The flat compute-dtype buffer (every rank's segments, as the all-gather returns
        them), a view of it per parameter (a DTensor with the parameter's placements under
        tp), and this rank's send segment; then the built parameters taken in."""
        self.compute_flat = torch.zeros(self.n * self.segment, dtype=self.compute_dtype, device=self.device)
        self._send = torch.zeros(self.segment, dtype=self.compute_dtype, device=self.device)
        self._compute: dict[int, torch.Tensor] = {}
        offset = 0
        for p in self.params:
            t = _local(p)
            view = self.compute_flat[offset: offset + t.numel()].view(t.shape)
            if isinstance(p, DTensor):
                view = DTensor.from_local(view, p.device_mesh, p.placements, run_check=False,
                                          shape=p.shape, stride=p.stride())
            self._compute[id(p)] = view
            offset += t.numel()
        self.masters_written()

    @torch.no_grad()
    def masters_written(self) -> None:
        """The fp32 parameters were set on every rank (built, loaded from a checkpoint):
        take this rank's segment of them into the master shard, cast them all into the
        compute buffer, and free them."""
        if self.compute_dtype is None:
            return
        if self._released:
            raise RuntimeError("ZeRO-1 masters_written() on released parameters (materialize() before loading)")
        for view, (p, a, b) in zip(self._views, self.pieces):
            view.copy_(_local(p).reshape(-1)[a:b])
        offset = 0
        for p in self.params:
            t = _local(p)
            self.compute_flat[offset: offset + t.numel()].copy_(t.reshape(-1))
            offset += t.numel()
        self.release()

    def release(self) -> None:
        """Free the module's fp32 parameters' storage (their values live in the ranks' master
        shards). A parameter whose storage holds more than itself (a view) is kept."""
        for p in self.params:
            t = _held(p)
            storage = t.untyped_storage()
            if storage.nbytes() and storage.nbytes() == t.numel() * t.element_size() and t.is_contiguous():
                storage.resize_(0)
                self._released.append(t)
        self.current = False
        self._versions = self._param_versions()

    def materialize(self) -> None:
        """Storage for every released parameter again (values undefined until written:
        ``sync_masters`` or a checkpoint load followed by ``masters_written``)."""
        for t in self._released:
            t.untyped_storage().resize_(t.numel() * t.element_size())
        self._released = []

    def held_param_bytes(self) -> int:
        """Bytes of fp32 parameter values this rank holds: the module's parameters that
        have storage, and the master shard."""
        held = sum(_held(p).untyped_storage().nbytes() for p in self.params)
        return held + (self.master_shard.numel() * self.master_shard.element_size()
                       if self.master_shard is not None else 0)

    def _param_versions(self) -> list[int]:
        return [_held(p)._version for p in self.params]

    def compute_copies(self) -> dict[int, torch.Tensor]:
        """The step's compute weights by ``id`` of the fp32 parameter: its values in the
        gathered buffer, with the gradient going to the parameter as a cast's would.
        Parameters this optimizer does not update are not in it (they are cast from their
        fp32 values, current everywhere)."""
        if self.compute_dtype is None:
            return {}
        if self._versions != self._param_versions():  # a write the buffer has not seen
            raise RuntimeError("ZeRO-1 with bf16 compute: fp32 master parameters were written outside the "
                               "optimizer; call masters_written() once they are set on every rank")
        return {id(p): _FromBuffer.apply(p, self._compute[id(p)]) for p in self.params}

    @torch.no_grad()
    def sync_masters(self) -> None:
        """Make every rank's fp32 parameters hold the current values (one fp32 all-gather of
        the master shards, counted on dp): before a checkpoint, an unsharded copy or an
        export. A no-op when they do; collective over the group otherwise (``current`` is
        the same on every rank). They stay until the next step frees them."""
        if self.compute_dtype is None or self.current:
            return
        self.materialize()
        self._gather(self.dtype, self._install_masters)
        self.current = True
        self._versions = self._param_versions()

    def _install_masters(self, flat: torch.Tensor) -> None:
        offset = 0
        for p in self.params:
            t = _local(p)
            t.copy_(flat[offset: offset + t.numel()].view_as(t))
            offset += t.numel()

    def _gather(self, dtype: torch.dtype, install=None) -> torch.Tensor:
        """All-gather every rank's updated segment, in ``dtype``: into the compute buffer
        (``dtype`` the compute dtype), or into a temporary flat tensor handed to ``install``."""
        if dtype == self.compute_dtype:
            flat, mine = self.compute_flat, self._send
        else:
            flat = torch.zeros(self.n * self.segment, dtype=dtype, device=self.device)
            mine = torch.zeros(self.segment, dtype=dtype, device=self.device)
        if self.master_shard is not None:  # the pieces end to end already: one copy (and cast)
            mine[: self.master_shard.numel()].copy_(self.master_shard)
        else:
            offset = 0
            for view in self._views:
                mine[offset: offset + view.numel()].copy_(view)
                offset += view.numel()
        comm.all_gather_into_tensor(flat, mine, self.group, "dp")
        if install is not None:
            install(flat)
        return flat

    # ------------------------------------------------------------------ the step

    @torch.no_grad()
    def step(self, closure=None):
        if self.optim is not None:
            for inner, outer in zip(self.optim.param_groups, self._inner_of):
                for k, v in self.param_groups[outer].items():
                    if k != "params":
                        inner[k] = v
            for view, (p, a, b) in zip(self._views, self.pieces):
                view.grad = None if p.grad is None else _local(p.grad).reshape(-1)[a:b]
            self.optim.step()
        if self.compute_dtype is not None:
            # bf16 on the wire, into the next step's compute weights; the module's fp32
            # parameters (gathered for a checkpoint since the last step) are out of date: freed
            self._gather(self.compute_dtype)
            self.release()
        else:
            self._gather(self.dtype, self._install_masters)
        for view in self._views:
            view.grad = None

    def zero_grad(self, set_to_none: bool = True):
        for p in self.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()


    # ------------------------------------------------------------------ checkpoint state (state.py)

    def before_checkpoint(self) -> None:
        """Under bf16 each rank holds fp32 values only for its own segment: gather them."""
        self.sync_masters()

    def checkpoint_boxes(self, model: ParamNames) -> list[Piece]:
        """This rank's pieces as checkpoint boxes (``zero_state.sharded_layout``), computed
        once: they are fixed for a run."""
        if self._boxes is None:
            try:
                self._boxes = sharded_layout(self, model.by_id)
            except ValueError as err:
                raise CheckpointStateError(str(err)) from None
        return self._boxes

    def checkpoint_state(self, model: ParamNames) -> dict[str, Any]:
        """The boxes of this rank's segment, views into its Adam state (no copy), in the
        same flattened naming and global shapes as every other layout; the step (the same
        on every rank, saved once) and every param-group entry."""
        state = {}
        for view, fqn, shape, boxes, writes in self.checkpoint_boxes(model):
            s = self.optim.state.get(view)
            if not s:
                continue
            state[f"state.{fqn}.step"] = s["step"]
            if writes:
                for k in ("exp_avg", "exp_avg_sq"):
                    state[f"state.{fqn}.{k}"] = chunks_of(shape, boxes, s[k])
        state.update(param_group_entries(self, model))
        return state

    def before_load(self) -> None:
        """Storage for the fp32 parameters to load into (bf16 compute frees them)."""
        self.materialize()

    def checkpoint_template(self, model: ParamNames, saved: set[str]) -> dict[str, Any]:
        """This rank's boxes of every parameter the checkpoint has state for (views into its
        state, made now where it has none yet: DCP reads straight into them, whatever
        layout wrote them), the step, and every param-group entry."""
        out: dict[str, Any] = {}
        for view, fqn, shape, boxes, _ in self.checkpoint_boxes(model):
            if not all(f"state.{fqn}.{k}" in saved for k in ADAM_KEYS):
                continue
            s = self.optim.state.get(view, {})
            out[f"state.{fqn}.step"] = torch.zeros((), dtype=torch.float32)
            for k in ("exp_avg", "exp_avg_sq"):
                flat = s.get(k)
                out[f"state.{fqn}.{k}"] = chunks_of(shape, boxes, torch.zeros_like(view) if flat is None else flat)
        out.update(param_group_entries(self, model, saved))
        return out

    def load_checkpoint_state(self, model: ParamNames, flat: dict[str, Any]) -> None:
        for view, fqn, _, _, _ in self.checkpoint_boxes(model):
            if f"state.{fqn}.exp_avg" not in flat:
                continue
            old = self.optim.state.get(view, {}).get("step")
            step = flat[f"state.{fqn}.step"].to(torch.float32 if old is None else old.dtype)
            self.optim.state[view] = {"step": step.clone(), "exp_avg": flat[f"state.{fqn}.exp_avg"].flat,
                                      "exp_avg_sq": flat[f"state.{fqn}.exp_avg_sq"].flat}
        load_param_groups(self, model, flat)

    def after_load(self) -> None:
        """The parameters were loaded on every rank: under bf16, take them into the master
        shard and the compute buffer (and free them again)."""
        self.masters_written()

class _FromBuffer(torch.autograd.Function):
    """``copy`` (a compute-dtype view of ZeRO-1's gathered buffer) as the compute weight of
    the fp32 ``master``: the gradient flows back to the master in its dtype, exactly as
    through the cast ``master.to(copy.dtype)`` it replaces (micro-batches accumulate in fp32)."""

    @staticmethod
    def forward(ctx, master, copy):
        ctx.dtype = master.dtype
        return copy.view_as(copy)

    @staticmethod
    def backward(ctx, grad):
        return grad.to(ctx.dtype), None
