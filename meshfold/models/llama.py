"""A Llama-style decoder that knows nothing of parallelism.

Parallel dimensions are applied from outside (``meshfold.parallel``): they swap submodules
(the core attention, the feed-forward), shard parameters, or drop the embedding/output from
pipeline stages. The model supports that by keeping those parts as named, optional
submodules and by taking token positions as an input (context parallel feeds non-contiguous
slices of the sequence).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

from meshfold.models.attention_ops import (DOCUMENT_TILE, chunk_attention, chunk_ids, compute_dtype,
                                          document_attention, document_plan, flash_varlen_ok, sdpa,
                                          window_attention)
from meshfold.models import registry
from meshfold.models.config import ModelConfig
from meshfold.models.feedforward import FeedForward
from meshfold.models.moe import MoE
from meshfold.models.moe_experts import _local


class RMSNorm(nn.Module):
    """x / rms(x) times the gain ``offset + weight``. ``offset`` is 0 here; a family's variant
    sets it as a class attribute (Gemma: 1, its weights start at 0), copied to the instance so
    it survives tensor parallel's class swap."""

    offset = 0.0

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.offset = type(self).offset
        self.weight = nn.Parameter(torch.ones(dim))

    def gain(self, weight: torch.Tensor) -> torch.Tensor:
        return weight + self.offset if self.offset else weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in at least fp32 so bf16 activations keep their accuracy.
        dtype = torch.promote_types(x.dtype, torch.float32)
        xf = x.to(dtype)
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return out.to(x.dtype) * self.gain(self.weight)


def rms_norm_class(cfg: ModelConfig) -> type:
    """The RMS norm class of the model: a family's variant when ``model.norm`` names one (it
    serves the per-head q/k norms too), else ``RMSNorm``."""
    variants = registry.norms()
    return registry.load(variants[cfg.norm]) if cfg.norm in variants else RMSNorm


def make_norm(cfg: ModelConfig) -> nn.Module:
    if cfg.norm == "layernorm":
        return nn.LayerNorm(cfg.dim, eps=cfg.norm_eps, bias=cfg.bias)
    return rms_norm_class(cfg)(cfg.dim, cfg.norm_eps)


def norm_start(cfg: ModelConfig) -> float:
    """The initial value of norm weights: a gain of 1 (``1 - offset`` of the model's norm)."""
    return 1.0 - getattr(rms_norm_class(cfg), "offset", 0.0)


def rope_frequencies(cfg: ModelConfig) -> tuple[torch.Tensor, float]:
    """Inverse frequencies (float64, head_dim/2) and the cos/sin scale of the model's RoPE,
    following the published scaling rules (the ones Hugging Face checkpoints name):
    ``linear`` (position interpolation), ``llama3`` (Llama 3.1: low frequencies divided by the
    factor, high ones kept, a smooth ramp between), ``dynamic`` (NTK-aware base for
    ``seq_len`` beyond the original context) and ``yarn`` (per-frequency ramp plus a
    temperature on cos/sin)."""
    d, theta, factor = cfg.rope_dim, cfg.rope_theta, cfg.rope_factor
    exponents = torch.arange(0, d, 2, dtype=torch.float64) / d
    kind = cfg.rope_scaling
    if kind == "dynamic":
        seq = max(cfg.seq_len, cfg.rope_original_seq_len)
        theta = theta * ((factor * seq / cfg.rope_original_seq_len) - (factor - 1)) ** (d / (d - 2))
    inv_freq = 1.0 / theta ** exponents
    scale = 1.0
    if kind == "linear":
        inv_freq = inv_freq / factor
    elif kind == "llama3":
        old = cfg.rope_original_seq_len
        low, high = cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        smooth = (old / wavelen - low) / (high - low)
        mixed = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        inv_freq = torch.where(wavelen > old / low, inv_freq / factor,
                               torch.where(wavelen < old / high, inv_freq, mixed))
    elif kind == "yarn":
        old = cfg.rope_original_seq_len

        def correction_dim(rotations: float) -> float:
            return d * math.log(old / (rotations * 2 * math.pi)) / (2 * math.log(theta))

        lo, hi = correction_dim(cfg.rope_beta_fast), correction_dim(cfg.rope_beta_slow)
        if cfg.rope_truncate:
            lo, hi = math.floor(lo), math.ceil(hi)
        lo, hi = max(lo, 0), min(hi, d - 1)
        hi = hi + 0.001 if lo == hi else hi
        ramp = ((torch.arange(d // 2, dtype=torch.float64) - lo) / (hi - lo)).clamp(0, 1)
        extrapolate = 1 - ramp  # 1: keep the original frequency, 0: interpolate by the factor
        inv_freq = inv_freq / factor * (1 - extrapolate) + inv_freq * extrapolate
        scale = cfg.rope_attention_factor or (0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0)
    return inv_freq, scale


def rope_tables(cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [seq_len, head_dim/2] (float64) for positions 0..seq_len-1."""
    inv_freq, scale = rope_frequencies(cfg)
    angles = torch.outer(torch.arange(cfg.seq_len, dtype=torch.float64), inv_freq)
    return angles.cos() * scale, angles.sin() * scale


def rope_variants(cfg: ModelConfig) -> list[tuple]:
    """The distinct RoPE key overrides of the layers (``registry.layer_attention``): index 0
    is the model's own (no override); a layer runs with table ``rope_variants(cfg).index(its)``."""
    variants: list[tuple] = [()]
    for layer in range(cfg.n_layers):
        rope = registry.layer_attention(cfg, layer).rope
        if rope not in variants:
            variants.append(rope)
    return variants


def rope_buffers(cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The model's RoPE buffers by name: ``rope_cos``/``rope_sin`` (the model's keys), then
    ``rope_cos_{i}``/``rope_sin_{i}`` for each layer override ``i`` (``rope_variants``)."""
    out = {}
    for i, rope in enumerate(rope_variants(cfg)):
        cos, sin = rope_tables(dataclasses.replace(cfg, **dict(rope)) if rope else cfg)
        suffix = f"_{i}" if i else ""
        out["rope_cos" + suffix], out["rope_sin" + suffix] = cos, sin
    return out


def _turn(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x's interleaved pairs (x[2i], x[2i+1]) turned by (cos, sin), as one complex multiply."""
    dtype = torch.promote_types(x.dtype, torch.float32)
    pairs = torch.view_as_complex(x.to(dtype).contiguous().unflatten(-1, (-1, 2)))
    turn = torch.complex(cos.to(dtype), sin.to(dtype)).unsqueeze(2)
    return torch.view_as_real(pairs * turn).flatten(-2).to(x.dtype)


class _Rotary(torch.autograd.Function):
    """RoPE as one complex multiply each way (Meta's reference and torchtitan multiply by a
    complex table too): forward and backward in two kernels, where the pairwise real form
    took ten strided ones (10x the time on this CPU, [8, 256, 6, 64]). It keeps the shared
    cos/sin tables for backward, not the complex table each call builds, which autograd
    would keep per call (q and k of every layer)."""

    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.save_for_backward(cos, sin)
        return _turn(x, cos, sin)

    @staticmethod
    def backward(ctx, grad):
        cos, sin = ctx.saved_tensors
        return _turn(grad, cos, -sin), None, None  # the inverse turn (cos and sin of -angle)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [batch, seq, heads, head_dim]; cos/sin: [batch or 1, seq, head_dim/2]."""
    return _Rotary.apply(x, cos, sin)


def apply_partial_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on the leading 2 * cos.shape[-1] features of each head, the rest passed through
    (partial RoPE, ``model.rope_fraction``); the whole head when the tables cover it."""
    turned = 2 * cos.shape[-1]
    if turned == x.shape[-1]:
        return apply_rotary(x, cos, sin)
    return torch.cat([apply_rotary(x[..., :turned], cos, sin), x[..., turned:]], dim=-1)


def l2_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x divided by its root mean square over the last dim (no weight), in at least fp32."""
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def temper_queries(q: torch.Tensor, positions: torch.Tensor | None, floor: float, strength: float) -> torch.Tensor:
    """Attention temperature tuning (Llama 4's NoPE layers): q [b, s, H, d] times
    1 + strength * log(1 + floor((position + 1) / floor)), per token."""
    pos = positions if positions is not None else torch.arange(q.shape[1], device=q.device).unsqueeze(0)
    dtype = torch.promote_types(q.dtype, torch.float32)
    factor = torch.log1p(torch.floor((pos.to(dtype) + 1.0) / floor)) * strength + 1.0
    return (q.to(dtype) * factor[:, :, None, None]).to(q.dtype)


def document_causal_mask(doc_ids_q: torch.Tensor, doc_ids_k: torch.Tensor, pos_q: torch.Tensor,
                         pos_k: torch.Tensor) -> torch.Tensor:
    """Boolean [batch, 1, q, k] mask: key visible if earlier-or-equal and in the same document."""
    same_doc = doc_ids_q.unsqueeze(-1) == doc_ids_k.unsqueeze(-2)
    causal = pos_q.unsqueeze(-1) >= pos_k.unsqueeze(-2)
    return (same_doc & causal).unsqueeze(1)


class CoreAttention(nn.Module):
    """softmax(QK^T/sqrt(d)) V with a causal (and optional per-document) mask.

    A separate module so context parallel can swap in ring or Ulysses attention and
    selective recomputation can checkpoint exactly this part.
    Inputs are [batch, seq, heads, head_dim]; ``doc_ids`` and ``positions`` are [batch, seq].
    With ``doc_ids`` (packed documents, contiguous runs of equal ids) attention runs per
    document (``attention_ops.document_attention``: key windows per query tile, never an
    S x S mask); ``dense = True`` is the S x S-mask reference the tests compare it with.
    ``sinks`` [heads]: attention sinks, a learned logit per head in the softmax's denominator
    (``attention_ops.sdpa``: through the fused kernels' log-sum-exp on every path).
    """

    def __init__(self, dense: bool = False, window: int = 0, scale: float | None = None, chunk: int = 0):
        super().__init__()
        self.dense = dense
        self.window = window  # > 0: sliding-window attention (each query's `window` latest keys)
        self.scale = scale  # softmax scale; None = 1/sqrt(head_dim)
        self.chunk = chunk  # > 0: chunked attention (within each chunk of `chunk` positions)
        # Transformer.forward plans the micro-batch's windows once with this tile.
        self.document_tile = None if (dense or window or chunk) else DOCUMENT_TILE

    def forward(self, q, k, v, positions=None, doc_ids=None, sinks=None):
        width = v.shape[-1]
        if width != q.shape[-1]:  # (latent attention: v narrower than q/k)
            # zero-padded to the q/k width and the output cut back: PyTorch's fused flash
            # kernels (CPU and CUDA) take one head width, and the fallback keeps the s x s
            # scores in fp32; as Hugging Face pads v for FlashAttention-2
            v = F.pad(v, (0, q.shape[-1] - width))
            return self.forward(q, k, v, positions, doc_ids, sinks)[..., :width]
        if self.window:
            return window_attention(q, k, v, self.window, positions, doc_ids, self.scale, sinks)
        if self.chunk and not self.dense:
            return chunk_attention(q, k, v, self.chunk, positions, doc_ids, self.scale)
        if self.chunk:  # the S x S reference: chunk boundaries are document boundaries
            pos = positions if positions is not None else torch.arange(q.shape[1], device=q.device).expand(
                q.shape[0], -1)
            doc_ids, positions = chunk_ids(doc_ids, pos, self.chunk), pos
        if doc_ids is not None and not self.dense:
            return document_attention(q, k, v, positions, doc_ids, self.document_tile, scale=self.scale, sinks=sinks)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        if doc_ids is None:
            out = sdpa(q, k, v, causal=True, scale=self.scale, sinks=sinks)
        else:
            pos = positions if positions is not None else torch.arange(q.shape[2], device=q.device).expand(
                q.shape[0], -1
            )
            mask = document_causal_mask(doc_ids, doc_ids, pos, pos)
            out = sdpa(q, k, v, mask=mask, scale=self.scale, sinks=sinks)
        return out.transpose(1, 2)


class Attention(nn.Module):
    """Grouped-query attention. ``head_dim`` may differ from dim/n_heads (Qwen3); q/k/v may
    carry biases without the output projection (``qkv_bias``, Qwen2); ``qk_norm`` applies an
    RMSNorm over each head's features of q and k before RoPE (Qwen3; the model's RMS norm
    variant). Layer ``layer_id``'s ``registry.layer_attention`` may give it a sliding window,
    a softmax scale and attention sinks (its RoPE table is the block's)."""

    def __init__(self, cfg: ModelConfig, layer_id: int = 0):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.n_kv_heads = cfg.kv_heads
        self.head_dim = cfg.head_dim
        self.use_rope = cfg.pos == "rope"
        qkv_bias = cfg.bias or cfg.qkv_bias
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * self.head_dim, bias=qkv_bias)
        self.wk = nn.Linear(cfg.dim, self.n_kv_heads * self.head_dim, bias=qkv_bias)
        self.wv = nn.Linear(cfg.dim, self.n_kv_heads * self.head_dim, bias=qkv_bias)
        self.wo = nn.Linear(cfg.n_heads * self.head_dim, cfg.dim, bias=cfg.bias)
        head_norm = rms_norm_class(cfg)
        self.q_norm = head_norm(self.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = head_norm(self.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        spec = registry.layer_attention(cfg, layer_id)
        self.use_rope = self.use_rope and not spec.nope
        self.l2_eps = cfg.norm_eps if spec.l2_qk_norm else None  # the weightless L2 (RMS) q/k norm
        self.temperature = spec.temperature
        self.core = CoreAttention(window=spec.window, scale=spec.scale or None, chunk=spec.chunk)
        # attention sinks (registry.LayerAttention.sinks): one logit per query head
        self.sinks = nn.Parameter(torch.zeros(cfg.n_heads)) if spec.sinks else None

    def forward(self, x, rope, positions=None, doc_ids=None):
        out = self.attend(self.wq(x), self.wk(x), self.wv(x), rope, positions, doc_ids)
        return self.wo(out)

    def attend(self, q, k, v, rope, positions=None, doc_ids=None):
        """Projected q/k/v [batch, seq, heads * head_dim] -> attention output of the same
        layout: per-head q/k norm, RoPE, core attention. The head count is read from the
        width (-1): tensor parallel leaves each rank a slice of the heads."""
        bsz, seq, _ = q.shape
        q, k, v = (t.view(bsz, seq, -1, self.head_dim) for t in (q, k, v))
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.l2_eps is not None:  # (before RoPE: a rotation keeps each head's norm)
            q, k = l2_norm(q, self.l2_eps), l2_norm(k, self.l2_eps)
        if self.use_rope:
            cos, sin = rope
            q, k = apply_partial_rotary(q, cos, sin), apply_partial_rotary(k, cos, sin)
        if self.temperature:
            q = temper_queries(q, positions, *self.temperature)
        if self.sinks is None:
            out = self.core(q, k, v, positions=positions, doc_ids=doc_ids)
        else:  # (this rank's heads under tensor parallel: the sinks are split with them)
            out = self.core(q, k, v, positions=positions, doc_ids=doc_ids, sinks=_local(self.sinks))
        return out.reshape(bsz, seq, -1)


def grouped_query_attention(cfg: ModelConfig, layer_id: int, parts) -> Attention:
    """The ``gqa`` attention kind's builder (``models/dense/__init__.py`` registers it)."""
    return Attention(cfg, layer_id)


# The shared pieces an attention kind's builder composes (registry.AttentionKind.build): the
# norm class, the core attention (a named submodule context parallel swaps) and RoPE.
BLOCK_PARTS = SimpleNamespace(rms_norm=RMSNorm, core=CoreAttention, rotary=apply_rotary)


class TransformerBlock(nn.Module):
    """Pre-norm block; with ``registry.post_norms`` the attention and feed-forward outputs are
    normalised too before the residual add (``post_attention_norm``, ``post_ffn_norm``; None
    otherwise). ``rope_index``: which of the model's RoPE tables the layer takes."""

    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.rope_index = rope_variants(cfg).index(registry.layer_attention(cfg, layer_id).rope)
        self.attention_norm = make_norm(cfg)
        # the attention kind the config asks for (registry: gqa, or a family's, e.g. mla)
        self.attention = registry.load(registry.attention_of(cfg).build)(cfg, layer_id, BLOCK_PARTS)
        self.ffn_norm = make_norm(cfg)
        if cfg.is_moe_layer(layer_id):
            self.feed_forward = MoE(cfg)
        else:
            self.feed_forward = FeedForward(cfg.dim, cfg.hidden_dim, cfg.mlp, cfg.bias)
        post = registry.post_norms(cfg)
        self.post_attention_norm = make_norm(cfg) if post else None
        self.post_ffn_norm = make_norm(cfg) if post else None

    def forward(self, x, rope, positions=None, doc_ids=None):
        a = self.attention(self.attention_norm(x), rope, positions, doc_ids)
        h = x + (a if self.post_attention_norm is None else self.post_attention_norm(a))
        f = self.feed_forward(self.ffn_norm(h))
        return h + (f if self.post_ffn_norm is None else self.post_ffn_norm(f))


class Transformer(nn.Module):
    """Decoder-only LM. ``tok_embeddings``/``norm``/``output`` and the extra heads may be
    ``None`` on pipeline stages that do not own them; ``layers`` is a ModuleDict keyed by the
    global layer index so parameter names (and hence initial values) are the same under any
    split. The extra heads (``registry.heads()``, e.g. DeepSeek's ``mtp``) are submodules named
    after their kind, None where the config leaves them off; they run after the final norm."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.pos_embeddings = nn.Embedding(cfg.seq_len, cfg.dim) if cfg.pos == "learned" else None
        self.layers = nn.ModuleDict({str(i): TransformerBlock(cfg, i) for i in range(cfg.n_layers)})
        self.norm = make_norm(cfg)
        self.output = None if cfg.tie_embeddings else nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.head_names = tuple(head.name for head in registry.heads())
        for head in registry.heads():
            self.add_module(head.name, registry.load(head.build)(cfg, make_norm, lambda i: TransformerBlock(cfg, i))
                            if head.active(cfg) else None)
        self.embedding_scale = registry.embedding_scale(cfg)
        for name, table in rope_buffers(cfg).items():  # rope_cos/rope_sin, then a table per layer override
            self.register_buffer(name, table, persistent=False)
        self.n_ropes = len(rope_variants(cfg))

    def _rope(self, positions, seq, device, index: int = 0):
        suffix = f"_{index}" if index else ""
        cos, sin = getattr(self, "rope_cos" + suffix), getattr(self, "rope_sin" + suffix)
        if positions is None:
            return cos[:seq].unsqueeze(0), sin[:seq].unsqueeze(0)
        return cos[positions], sin[positions]

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None,
                doc_ids: torch.Tensor | None = None, ids: torch.Tensor | None = None):
        """tokens: [batch, seq] ids (or [batch, seq, dim] hidden states on a later pipeline
        stage). Returns logits [batch, seq, vocab] (or hidden states if there is no output), or
        what an extra head makes of them (multi-token prediction in training: an
        ``MTPOutput``; ``ids``: the token ids, needed when ``tokens`` are hidden states, on the
        last pipeline stage)."""
        is_ids = not tokens.is_floating_point()
        h = self.tok_embeddings(tokens) if (self.tok_embeddings is not None and is_ids) else tokens
        if h is not tokens and self.embedding_scale != 1.0:  # a family's scale on the embeddings (Gemma: sqrt(dim))
            h = h * self.embedding_scale
        seq = h.shape[1]
        if self.pos_embeddings is not None:
            pos = positions if positions is not None else torch.arange(seq, device=h.device)
            h = h + self.pos_embeddings(pos)
        ropes = [self._rope(positions, seq, h.device, i) for i in range(self.n_ropes)]
        rope = ropes[0]
        if doc_ids is not None:  # the documents' attention windows: once per micro-batch, not per layer
            tiles = (getattr(layer.attention.core, "document_tile", None) for layer in self.layers.values())
            tile = next((t for t in tiles if t is not None), None)  # (windowed layers plan none)
            if tile is not None:
                qk, v = registry.attention_of(self.cfg).widths(self.cfg)
                document_plan(doc_ids, positions, tile).prepare(flash_varlen_ok(h, compute_dtype(h), qk, v))
        for layer in self.layers.values():
            h = layer(h, ropes[layer.rope_index], positions, doc_ids)
        if self.norm is not None:
            h = self.norm(h)
        out = self.project(h)
        if self.norm is None:
            return out
        for name in self.head_names:
            head = getattr(self, name)
            if head is not None:
                out = head.predict(self, h, out, tokens if is_ids else ids, rope, positions, doc_ids)
        return out

    def blocks(self) -> list[nn.Module]:
        """The decoder blocks in the order they run: the trunk's layers (this stage's), then
        those of the extra heads (each multi-token prediction depth's block)."""
        extra = [head.block for head in (self.mtp or {}).values()]  # (None when there are none)
        return list(self.layers.values()) + extra

    def project(self, h: torch.Tensor) -> torch.Tensor:
        if self.output is not None:
            return self.output(h)
        if self.cfg.tie_embeddings and self.tok_embeddings is not None:
            return F.linear(h, self.tok_embeddings.weight)
        return h


# --------------------------------------------------------------------------- initialisation


def _param_seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


# Random initial values are generated in tiles over the first two dimensions (the rest
# whole), each tile from its own generator keyed by (seed, name, tile), so any box of a
# parameter (a tensor/expert/FSDP shard) can be generated without the rest of it: a rank
# pays CPU time and memory for the tiles its shard overlaps, never the whole parameter.
_TILE_COLS = 1024
_TILE_ELEMENTS = 1 << 20


def _tile_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    """Rows and columns of one tile of a parameter of ``shape`` (at least 2-D; fixed by the
    shape alone)."""
    cols = min(shape[1], _TILE_COLS)
    trailing = math.prod(shape[2:])
    return max(1, _TILE_ELEMENTS // max(1, cols * trailing)), max(1, cols)


def _tile_seed(param_seed: int, i: int, j: int) -> int:
    digest = hashlib.sha256(f"{param_seed}:{i}:{j}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def init_std(name: str, cfg: ModelConfig) -> float:
    # GPT-2/Megatron: scale the residual-stream output projections by depth.
    if name.endswith(("wo.weight", "w2.weight", "w2")):
        return 0.02 / math.sqrt(2 * cfg.n_layers)
    return 0.02


@torch.no_grad()
def fill_initial_(out: torch.Tensor, name: str, shape: tuple[int, ...], offset: tuple[int, ...],
                  cfg: ModelConfig, seed: int) -> torch.Tensor:
    """Fill ``out`` with the box of parameter ``name``'s initial value (full shape ``shape``)
    that starts at ``offset``: ``full[offset[0]:offset[0]+out.shape[0], ...]``.

    The values depend on the name, the full shape and the seed only, so every layout (and
    every pipeline stage, which holds only some names) gets the same numbers; memory beyond
    ``out`` is one tile (4 MiB)."""
    shape, offset = tuple(shape), tuple(offset)
    if len(offset) != len(shape) or out.dim() != len(shape) or any(
            o < 0 or o + n > s for o, n, s in zip(offset, out.shape, shape)):
        raise ValueError(f"init of {name}: box at {offset} of size {tuple(out.shape)} "
                         f"is not inside the parameter's shape {shape}")
    leaf = name.rsplit(".", 1)[-1]
    if leaf.endswith("bias"):  # (the routed experts' w13_bias / w2_bias too)
        return out.zero_()
    if "norm" in name:
        return out.fill_(norm_start(cfg))
    if out.numel() == 0:
        return out
    std = init_std(name, cfg)
    pseed = _param_seed(seed, name)
    if len(shape) < 2:  # vectors: tiles along dim 0 only
        shape, offset, view = shape + (1,), offset + (0,), out.unsqueeze(1)
    else:
        view = out
    rows, cols = _tile_shape(shape)
    lo0, hi0 = offset[0], offset[0] + view.shape[0]
    lo1, hi1 = offset[1], offset[1] + view.shape[1]
    rest = tuple(slice(o, o + n) for o, n in zip(offset[2:], view.shape[2:]))
    gen = torch.Generator()
    for i in range(lo0 // rows, (hi0 - 1) // rows + 1):
        r0, r1 = i * rows, min((i + 1) * rows, shape[0])
        for j in range(lo1 // cols, (hi1 - 1) // cols + 1):
            c0, c1 = j * cols, min((j + 1) * cols, shape[1])
            gen.manual_seed(_tile_seed(pseed, i, j))
            tile = torch.randn((r1 - r0, c1 - c0) + shape[2:], generator=gen).mul_(std)
            a0, a1, b0, b1 = max(lo0, r0), min(hi0, r1), max(lo1, c0), min(hi1, c1)
            view[a0 - lo0:a1 - lo0, b0 - lo1:b1 - lo1].copy_(tile[(slice(a0 - r0, a1 - r0), slice(b0 - c0, b1 - c0)) + rest])
    return out


def init_value(name: str, shape: torch.Size, cfg: ModelConfig, seed: int) -> torch.Tensor:
    """The initial value of parameter ``name`` as a full (unsharded) float32 tensor."""
    return fill_initial_(torch.empty(tuple(shape)), name, tuple(shape), (0,) * len(shape), cfg, seed)


@torch.no_grad()
def init_weights(model: nn.Module, cfg: ModelConfig, seed: int) -> None:
    """Initialise every parameter of an unsharded model (or pipeline stage) in place.
    (Sharded models built on the meta device: ``meshfold.parallel.materialize``.)"""
    for name, param in model.named_parameters():
        fill_initial_(param, name, tuple(param.shape), (0,) * param.dim(), cfg, seed)
    init_buffers(model, cfg)


@torch.no_grad()
def init_buffers(model: nn.Module, cfg: ModelConfig) -> None:
    """Recompute the buffers (rotary tables, MoE routing biases) in place: after a model
    built on the meta device is given storage, they hold garbage."""
    for module in model.modules():
        if isinstance(module, Transformer):
            for name, table in rope_buffers(cfg).items():  # with the model's (and layers') RoPE keys
                buf = getattr(module, name)
                buf.copy_(table.to(buf.dtype))
    for name, buf in model.named_buffers():
        if name.endswith("expert_bias"):
            buf.zero_()
