"""``lowcomm.compression`` on the per-step data-parallel path: a DDP communication hook.

DDP hands the hook one bucket of gradients (flat buffer plus per-parameter views); the
hook runs the codec on the per-parameter views (PowerSGD and L-GreCo need the matrix
shapes), writes the decoded group mean back into them and returns the buffer. The codec's
step counter advances once per backward (on bucket 0, which DDP always reduces).
PowerSGD and L-GreCo return an unfinished future (their work runs on the codec's
communication thread while backward goes on; ``codecs/powersgd.py`` says why a thread);
the other codecs reduce before returning.

With ``lowcomm.onebit_adam`` the hook all-reduces in full precision during the 1-bit Adam
warm-up (asynchronously: the future completes when the all-reduce does) and afterwards
leaves gradients local: the optimizer then exchanges the 1-bit
compressed momentum itself (``onebit_adam.py``).

FSDP (zero >= 2 with dp_shard > 1) reduce-scatters inside FSDP2 with no hook to replace the
collective, so compression is refused there by ``validate`` (one line naming the keys).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from meshfold import comm
from meshfold.lowcomm.config import LowCommConfig
from meshfold.lowcomm.codecs import build_codec


class CompressionState:
    def __init__(self, lc: LowCommConfig, group, names: dict[int, str], seed: int):
        self.lc = lc
        self.group = group
        self.n = dist.get_world_size(group)
        self.names = names
        self.codec = None if lc.onebit_adam else build_codec(lc.compression, group, lc, seed)
        self.optimizer = None  # OneBitAdam, set once built (its ``frozen`` flag drives the hook)


def _hook(state: CompressionState, bucket):
    buf = bucket.buffer()
    if state.lc.onebit_adam:
        if state.optimizer is None or not state.optimizer.frozen:
            work = comm.all_reduce(buf, state.group, "dp", async_op=True)
            return work.get_future().then(lambda fut: fut.value()[0].div_(state.n))
        return _done(buf)
    if bucket.index() == 0:
        state.codec.step_begin()
    named = [(state.names[id(p)], g) for p, g in zip(bucket.parameters(), bucket.gradients())]

    def written_back(_):
        # bucket.gradients() are views of the buffer, but copy back defensively.
        offset = 0
        for _, g in named:
            view = buf[offset: offset + g.numel()]
            if view.data_ptr() != g.data_ptr():
                view.copy_(g.reshape(-1))
            offset += g.numel()
        return buf

    # PowerSGD / L-GreCo: an unfinished future, the exchange overlaps the rest of backward.
    return state.codec.reduce_async(named).then(written_back)


def _done(buf: torch.Tensor) -> torch.futures.Future:
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(buf)
    return fut


class DDPCompression:
    """The compressing hook of ``lowcomm.compression``, owned by the lowcomm feature. DDP
    takes one communication hook, chosen where DDP is built: the trainer hands ``install``
    to ``parallelize`` (``parallel/dp/plan.py`` takes it as an explicit argument), and the
    feature (``LowComm``) reads the state the hook uses from ``state``."""

    def __init__(self, lc: LowCommConfig, seed: int = 0):
        self.lc, self.seed = lc, seed
        self.state: CompressionState | None = None  # set once ``install`` has seen the DDP module

    def install(self, ddp, group) -> None:
        """Register the compressing hook on ``ddp`` (in place of the counting all-reduce)."""
        names = {id(p): n for n, p in ddp.module.named_parameters()}
        self.state = CompressionState(self.lc, group, names, self.seed)
        ddp.register_comm_hook(self.state, _hook)


def build_compression(lc: LowCommConfig, seed: int = 0) -> DDPCompression | None:
    """The hook owner when ``lowcomm.compression`` asks for one, else None."""
    return None if lc.compression == "none" else DDPCompression(lc, seed)
