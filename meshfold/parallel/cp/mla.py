"""Context parallel for multi-head latent attention (``models/deepseek/mla.py``), registered in
``parallel/cp/plan.py``'s ``ATTENTION_ADAPTERS`` under ``"mla"``: on a pure ring the
per-token latent (kv_rank + rope values) travels instead of the expanded keys and values,
each step expanding it locally; Ulysses and hybrid move the expanded heads."""

from __future__ import annotations

import types

import torch

from meshfold.models.deepseek.mla import MLAttention
from meshfold.parallel.cp.groups import ContextParallelPlan


def send_latent_on_ring(attention: MLAttention, plan: ContextParallelPlan) -> None:
    """On a pure ring (no Ulysses), ``attend`` sends the latent (``_latent_ring_attend``)."""
    if plan.ulysses == 1:
        attention.attend = types.MethodType(_latent_ring_attend, attention)


class LatentPayload:
    """What travels on the ring for latent attention (``models/deepseek/mla.py``): the per-token
    latent [b, s, kv_rank + rope] (the normed compressed kv and the RoPE'd shared key),
    expanded into per-head k and v by ``expand`` at every ring step, forward and backward.
    Its gradient travels back the same way; ``expand``'s parameters (``wkv_b``) get theirs
    locally, through autograd of the re-run expansion, under the forward's autocast."""

    def __init__(self, expand, params: tuple, device_type: str):
        self.expand, self.params = expand, params
        self.device_type = device_type
        self.autocast = (torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type))
        self.leaf = self.kx = self.vx = None

    def pack(self, latent, _):
        return latent.contiguous()

    def unpack(self, cur):
        k, v = self.expand(cur)
        return k.transpose(1, 2), v.transpose(1, 2)

    def open(self, cur):
        enabled, dtype = self.autocast
        with torch.enable_grad(), torch.autocast(self.device_type, dtype=dtype, enabled=enabled):
            self.leaf = cur.detach().requires_grad_()
            self.kx, self.vx = self.unpack(self.leaf)
        acc = torch.promote_types(self.kx.dtype, torch.float32)
        state = [torch.zeros(x.shape, dtype=acc, device=cur.device) for x in (self.kx, self.vx)]
        return self.kx.detach(), self.vx.detach(), state

    def add(self, state, ks, dk, dv):
        state[0][:, :, ks] += dk
        state[1][:, :, ks] += dv

    def close(self, state, param_grads):
        got = torch.autograd.grad((self.kx, self.vx), (self.leaf, *self.params),
                                  (state[0].to(self.kx.dtype), state[1].to(self.vx.dtype)), allow_unused=True)
        for i, g in enumerate(got[1:]):
            if g is not None:
                param_grads[i] = g if param_grads[i] is None else param_grads[i] + g
        self.leaf = self.kx = self.vx = None
        return got[0].to(torch.promote_types(got[0].dtype, torch.float32))

    def grads(self, dcur, k, v):
        return dcur.to(k.dtype), None


def _latent_ring_attend(self: MLAttention, q, latent, positions=None, doc_ids=None):
    """``MLAttention.attend`` under ring cp: the latent (kv_rank + rope values per token, in
    the compute dtype, which is all ``wkv_b`` reads of it) travels on the ring instead of
    the expanded keys and values; each step expands it (``expand``, ``wkv_b``) locally.
    Through the core module, so selective recompute still wraps it."""
    if torch.is_autocast_enabled(latent.device.type):
        latent = latent.to(torch.get_autocast_dtype(latent.device.type))
    payload = LatentPayload(self.expand, tuple(self.wkv_b.parameters()), q.device.type)
    return self.core(q, latent, None, positions=positions, doc_ids=doc_ids, payload=payload)
