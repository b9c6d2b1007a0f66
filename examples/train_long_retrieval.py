"""Train a small LM on synthetic long-range retrieval: dense warmup then MSA, next to dense.

Two copies of one small decoder-only LM (same initial weights, same batches, same optimizer)
learn a multi-query associative-recall task over long sequences:

- ``msa``: every attention layer is a :class:`flash_msa.nn.MSAttention`. The first
  ``--warmup-steps`` steps run it with ``warmup=True`` (dense causal attention; the KL over all
  visible keys trains the proxy), the rest sparse (``top_k`` blocks of ``block_size`` tokens per
  query, chosen by the proxy; the KL over the kept keys keeps training it).
- ``dense`` (``--dense-baseline``, the default): the same layers with plain dense causal
  attention, ``F.scaled_dot_product_attention`` (FlashAttention/cuDNN on a GPU; the math path
  is refused there, so a silent O(S^2)-memory fallback cannot distort the timing), or
  FlashAttention-4 with ``--dense-impl fa4`` where it is installed. Not ``MSAttention`` with
  ``warmup=True``: that is dense attention *plus* the proxy and its KL, so it would overstate
  the dense model's step time. ``warmup=True`` computes the same attention output
  (tests/api/test_nn.py checks it against SDPA), so during warmup the two runs differ only by
  kernel rounding (tests/integration/test_examples.py checks the losses match). The dense model has the
  same parameters minus the indexers, copied from the MSA model's initial state.

Model (per layer, pre-norm): ``h = RMSNorm(x)``, ``h = h + conv(h)``, ``x = x + attn(h)``, then
``x = x + SwiGLU(RMSNorm(x))``; a final RMSNorm and an LM head tied to the token embedding
(``N(0, 1/d)`` init), applied at the query positions only. ``conv`` is a causal depthwise
convolution of width ``--conv-width`` (4; 1 turns it off), as Mamba and other recent
architectures put before their sequence mixer: it puts a token's predecessors into its
attention input, so that one attention layer can match a query key with the value that
followed it in the context, instead of a two-layer induction circuit. Attention: GQA
``num_heads`` / ``num_kv_heads``, ``head_dim = hidden_size / num_heads``, RoPE on q/k
(``rope_theta`` 1e6, so that content matching survives 16K-64K token distances); the indexer
has the MSA paper's shape: one proxy head per KV group (``Hp = num_kv_heads``), one proxy key
head, ``proxy_head_dim``, q/k RMSNorm and RoPE, detached input.

Why these choices (measured on CPU with the dense model: 128-token sequences of 8 pairs, batch
32, fp32; accuracy over the last steps): at d=64 (64 keys, 32 values, lr 3e-3) the model sat at
the "some value of the context" plateau (1/8 to 1/5) after 600 steps with an untied head (15%)
and with a tied head but no convolution (20%, the two-layer induction circuit not found), and
reached 100% in about 300 steps with both; at d=256, lr 1e-3 (the GPU default), untied with
2048 keys and 256 values it was at 18% after 1500 steps, tied with 1024 keys and 64 values at
100% after about 400 (lr 3e-3 stayed at 14%).

Task (one sequence of ``S`` tokens; vocabulary = filler, key and value tokens, disjoint
ranges):

- filler: uniform random filler tokens everywhere;
- context: ``--pairs`` key-value pairs ``(key, value)`` at random 2-aligned positions
  ``(2s, 2s+1)`` before the last block boundary that precedes the queries (a pair never
  straddles a block, since blocks are 64 or 128 tokens, and no pair shares a block with a
  query); keys are distinct within a sequence, values are random;
- queries: the last ``2 * --queries`` tokens are ``(key, value)`` pairs repeating distinct
  context pairs in random order. At each query key's position (a "query token") the
  next-token target is the value that followed that key in the context, up to ``S`` tokens
  back.

The loss is the cross entropy of the next token at the query tokens only (the filler is
random, so nothing else is predictable). Task accuracy = exact match of the answer token
(argmax of the LM head = the value), over all query tokens of the batch. Every step draws a
fresh batch (seeded by ``--seed``, the step and the length), so a step's accuracy is measured
before the model has seen that batch; the final evaluation uses ``--eval-batches`` held-out
batches at the full length.

Length curriculum (``--curriculum-steps``, ``--min-seqlen``): the first steps use shorter
sequences, ``min_seqlen * 2**k`` tokens with the same tokens per step (see
:func:`curriculum_seqlen`). At initialization the attention a query puts on its answer, and so
the gradient that builds the lookup, falls as 1/length: the lookup is found at 128 tokens in a
few hundred steps and then carries over to each doubling in tens of steps (CPU, dense model,
d=64, 512 keys, 64 values: 300 steps at 128 tokens, 150 at 256, 150 at 512, then 1024 tokens:
88% accuracy over its first 40 steps, 98% over steps 160-200, 95% held out). These steps are
part of the MSA model's dense warmup, which must end at full length and last until the proxy
finds the answers: in a CPU run at 512 tokens (d=64, 100 dense steps at full length) the MSA
model turned sparse while its first layer's proxy recall was 0.66 and then fell behind the
dense model (held out: 73% against 79%; 76% with its own layers run dense).

Schedule: AdamW (betas 0.9/0.95, no weight decay), linear LR warmup for ``--lr-warmup`` steps,
then cosine decay to 10%; gradient-norm clipping at 1.0 over the backbone (the parameters both
models share), so the indexers' KL gradients do not change the backbone's clipping and both
runs clip alike. The KL enters the loss through ``MSAttention``'s ``kl_coeff`` (``--kl-coeff``,
default 1.0): its gradient rides on each layer's output backward (:func:`flash_msa.nn.attach_kl`),
i.e. the MSA model minimizes ``task_loss + kl_coeff * sum over layers of KL_l``. With the
indexer's detached input that gradient reaches only the indexers, and Adam's update is
invariant to a constant factor on a parameter's gradient, so ``kl_coeff`` hardly matters here
(it would with SGD, or with the indexers inside the clipped set).

Metrics, one JSON object per step and model in ``OUT/msa.jsonl`` and ``OUT/dense.jsonl``:

- ``loss``: the task loss (mean cross entropy over query tokens);
- ``acc``: the task accuracy of the step's batch;
- ``kl``: mean over layers of the layer's proxy KL (``MSAttention.last_kl``: the mean over
  ``Hp * tokens`` rows of ``KL(main attention || proxy)``; over all visible keys in warmup
  steps, over the kept keys in sparse steps); ``null`` for dense;
- ``recall``: the proxy's recall of the answer's block. For layer ``l``, proxy head ``p`` and
  query token ``i`` of sequence ``b``, let ``I_l[b, i, p]`` be the ``top_k`` blocks that
  :func:`flash_msa.select_blocks` returns for the layer's proxy queries and keys (the layer's
  indexer applied to the layer's input of that step, before the optimizer update; in sparse
  steps this is exactly the selection the layer attended to, in warmup steps the one it would
  have used), ``a[b, i]`` the block holding the queried context pair and
  ``hit_l[b, i, p] = [a[b, i] in I_l[b, i, p]]``. Then ``recall_layers[l]`` = the mean of
  ``hit_l`` over ``b, i, p``, and ``recall`` = the mean of ``recall_layers`` over layers
  (queries, proxy heads and layers weigh equally). ``null`` for dense. Chance level is about
  ``(top_k - 1) / (number of blocks before the query)``, and 1 where a sequence has at most
  ``top_k`` blocks (every block is kept: with the GPU defaults, the curriculum's sequences up
  to 2048 tokens);
- ``answer_mass_layers``: per layer, the dense causal attention's probability mass on the
  answer's block at the query tokens (softmax of the layer's own q/k over all visible keys,
  averaged over queries and main heads; for MSA in sparse steps, what dense attention would
  put there). It says which layers look the answer up: a layer that does not (measured on CPU,
  2 layers at 1024 tokens: the second layer's proxy recall stayed at chance, 0.21 for
  ``top_k`` 4 of 16 blocks, while the first layer's was 0.94) gets no KL signal towards the
  answer's block, and drags the plain mean ``recall`` down although its attention loses
  nothing;
- ``recall_weighted``: recall weighted by that need: ``sum m * hit / sum m`` over layers,
  ``b``, ``i``, ``p``, where ``m_l[b, i, p]`` is the answer mass averaged over the main heads
  of proxy head ``p``'s group: the fraction of the attention's demand for the answer's block
  that the selection serves. ``null`` for dense;
- ``step_ms``: wall time of forward, backward, clipping and optimizer step (device
  synchronized; the recall measurement and data generation are outside it);
- also ``step``, ``phase`` (``warmup``/``sparse``/``dense``), ``seqlen``, ``batch_size``,
  ``lr``.

``OUT/summary.json`` holds the configuration, the environment, each model's final evaluation
(the same metrics over ``--eval-batches`` held-out full-length batches; the MSA model both
sparse and with dense attention) and the median step times over the sparse phase (steps
``warmup_steps + 5`` on, the same window for both models; the first sparse steps compile
kernels). ``--plot FILE`` draws loss, accuracy, KL, recall, answer mass and step time against
the step for both runs (needs matplotlib); ``--plot-only`` redraws it from ``OUT``
without training (e.g. on another machine than the one that trained). ``--no-msa`` /
``--no-dense-baseline`` train one model only (two commands can fill one ``OUT``; the summary
keeps the other model's entries).

Run (the H200 run; ``--seqlen`` 16384 to 65536, ``--batch-size`` defaults to 65536 / seqlen):

    PYTHONPATH=src python examples/train_long_retrieval.py --seqlen 16384 --out runs/lr16k

and on CPU, a few seconds (what tests/integration/test_examples.py runs):

    python examples/train_long_retrieval.py --device cpu --tiny --out /tmp/lr-tiny

On CPU the ops run on the ``torch`` backend in fp32 (``--backend`` chooses another one; the
Triton interpreter is far too slow to train with); on a GPU under ``FLASH_MSA_BACKEND`` or
``auto``, in bf16 autocast with fp32 weights. Seeds make the batches and the initial weights
reproducible; GPU kernels with atomics are not bitwise deterministic.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import pathlib
import platform
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

import flash_msa
from flash_msa import backends
from flash_msa.nn import MSAIndexer, MSAttention, RotaryEmbedding


# ---------------------------------------------------------------------------------------------
# configuration
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Config:
    """Everything a run depends on (the GPU defaults; :data:`TINY` overrides some)."""

    seqlen: int = 16384
    batch_size: int | None = None  # None: max(1, 65536 // seqlen), 64K tokens per step
    steps: int = 3000
    warmup_steps: int = 2000  # dense (warmup=True) steps of the MSA model, curriculum included
    curriculum_steps: int = 1600  # steps on shorter sequences (see curriculum_seqlen)
    min_seqlen: int = 128  # the curriculum's first length
    top_k: int = 16
    block_size: int = 128
    layers: int = 2
    hidden_size: int = 256
    num_heads: int = 4
    num_kv_heads: int = 2
    proxy_head_dim: int = 64
    intermediate_size: int = 768
    conv_width: int = 4  # causal depthwise convolution before attention; 1: none
    tie_embeddings: bool = True  # the LM head is the token embedding
    rope_theta: float = 1e6
    pairs: int | None = None  # None: min(seqlen // 64, 512)
    queries: int = 64
    num_keys: int = 1024
    num_values: int = 64
    num_filler: int = 64
    lr: float = 1e-3
    lr_warmup: int = 100
    kl_coeff: float = 1.0
    eval_batches: int = 8
    seed: int = 0
    dtype: str = "bf16"  # bf16: autocast with fp32 weights; fp32: plain fp32

    def resolved(self) -> Config:
        """A copy with the ``None`` defaults filled in, checked."""
        c = dataclasses.replace(self)
        if c.batch_size is None:
            c.batch_size = max(1, 65536 // c.seqlen)
        if c.pairs is None:
            c.pairs = min(c.seqlen // 64, 512)
        may_be_zero = ("warmup_steps", "curriculum_steps", "lr_warmup", "seed")
        for f in dataclasses.fields(c):
            low = 0 if f.name in may_be_zero else 1
            if f.type in ("int", "int | None") and getattr(c, f.name) < low:
                raise ValueError(f"{f.name} must be >= {low}, got {getattr(c, f.name)}")
        for name in ("rope_theta", "lr"):
            if not getattr(c, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(c, name)}")
        if not 0 <= c.warmup_steps <= c.steps:
            raise ValueError(f"warmup_steps must be in [0, steps={c.steps}], got {c.warmup_steps}")
        if not 0 <= c.curriculum_steps <= c.warmup_steps:
            raise ValueError(
                f"curriculum_steps must be in [0, warmup_steps={c.warmup_steps}] (the shorter "
                f"sequences are trained dense), got {c.curriculum_steps}"
            )
        if c.block_size not in (64, 128):
            raise ValueError(f"block_size must be 64 or 128, got {c.block_size}")
        if c.hidden_size % c.num_heads or c.num_heads % c.num_kv_heads:
            raise ValueError(
                f"hidden_size ({c.hidden_size}) must be a multiple of num_heads ({c.num_heads}), "
                f"and num_heads of num_kv_heads ({c.num_kv_heads})"
            )
        if not c.queries <= c.pairs <= c.num_keys:
            raise ValueError(
                f"need queries ({c.queries}) <= pairs ({c.pairs}) <= num_keys ({c.num_keys})"
            )
        if c.dtype not in ("bf16", "fp32"):
            raise ValueError(f"dtype must be bf16 or fp32, got {c.dtype!r}")
        for length in {*curriculum_lengths(c), c.seqlen}:
            stage = stage_config(c, length)
            context = _context_tokens(stage, length == c.seqlen)
            if 2 * stage.pairs > context:
                raise ValueError(
                    f"{stage.pairs} pairs do not fit in the {context}-token context of "
                    f"{length}-token sequences with {stage.queries} queries; lower pairs, or "
                    "raise seqlen or min_seqlen"
                )
        return c


# CPU smoke preset: 8 blocks of 64 tokens, top_k 3, one curriculum length; seconds (CI)
TINY = dict(
    seqlen=512,
    batch_size=2,
    steps=8,
    warmup_steps=4,
    curriculum_steps=2,
    min_seqlen=256,
    top_k=3,
    block_size=64,
    hidden_size=64,
    num_heads=4,
    num_kv_heads=2,
    proxy_head_dim=16,
    intermediate_size=128,
    pairs=16,
    queries=16,
    num_keys=64,
    num_values=32,
    num_filler=32,
    lr=3e-3,
    lr_warmup=2,
    eval_batches=1,
    dtype="fp32",
)


def curriculum_lengths(cfg: Config) -> list[int]:
    """The curriculum's sequence lengths: ``min_seqlen * 2**k`` below ``seqlen`` (empty without
    curriculum steps)."""
    lengths, length = [], cfg.min_seqlen
    while cfg.curriculum_steps and length < cfg.seqlen:
        lengths.append(length)
        length *= 2
    return lengths


def curriculum_seqlen(cfg: Config, step: int) -> int:
    """The sequence length of ``step``: the first half of the curriculum steps at
    ``min_seqlen`` (where the model has to discover the lookup: the fraction of attention that
    lands on the answer at initialization, and with it the gradient that builds the lookup,
    falls as 1/length), the second half split evenly over the doublings; then ``seqlen``."""
    lengths = curriculum_lengths(cfg)
    if step >= cfg.curriculum_steps or not lengths:
        return cfg.seqlen
    first = cfg.curriculum_steps // 2
    if step < first or len(lengths) == 1:
        return lengths[0]
    rest = cfg.curriculum_steps - first
    return lengths[1 + (step - first) * (len(lengths) - 1) // rest]


def stage_config(cfg: Config, length: int) -> Config:
    """The task at ``length`` tokens: the same tokens per step (``batch_size * seqlen``) and
    vocabulary; ``min(queries, length // 16)`` queries and ``min(pairs, max(queries,
    length // 64))`` pairs. ``cfg`` itself at ``length == seqlen``."""
    if length == cfg.seqlen:
        return cfg
    queries = max(1, min(cfg.queries, length // 16))
    return dataclasses.replace(
        cfg,
        seqlen=length,
        batch_size=max(1, cfg.batch_size * cfg.seqlen // length),
        queries=queries,
        pairs=min(cfg.pairs, max(queries, length // 64)),
    )


def _context_tokens(stage: Config, full_length: bool) -> int:
    """Where the pairs end: the last block boundary (64 tokens in the curriculum's shorter
    sequences) before the queries, so that at full length no pair shares a query's block."""
    align = stage.block_size if full_length else 64
    return (stage.seqlen - 2 * stage.queries) // align * align


# ---------------------------------------------------------------------------------------------
# the task
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Batch:
    """One batch of the retrieval task (all int64, on the training device).

    tokens: ``(B, S)``; query_pos: ``(B, Q)`` positions of the query keys (their next token is
    the answer); answers: ``(B, Q)`` the value tokens to predict; answer_pos: ``(B, Q)`` the
    position of each queried pair's value token in the context (the key sits just before it,
    in the same block).
    """

    tokens: torch.Tensor
    query_pos: torch.Tensor
    answers: torch.Tensor
    answer_pos: torch.Tensor


class RetrievalTask:
    """Multi-query associative recall in filler text (see the module docstring).

    Vocabulary: filler ``[0, F)``, keys ``[F, F + K)``, values ``[F + K, F + K + V)``, the same
    at every curriculum length.
    """

    TRAIN, EVAL = 0, 1  # data streams: a batch depends only on (seed, stream, index, length)

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.key0 = cfg.num_filler
        self.value0 = self.key0 + cfg.num_keys
        self.vocab_size = self.value0 + cfg.num_values

    def batch(self, stream: int, index: int, device, length: int | None = None) -> Batch:
        """Batch ``index`` of ``stream`` at ``length`` tokens (default the full length), drawn
        on ``device`` (the same on every run on that kind of device; CPU and CUDA draw
        different batches)."""
        length = self.cfg.seqlen if length is None else length
        c = stage_config(self.cfg, length)
        device = torch.device(device)
        # tuples of ints hash the same in every process (PYTHONHASHSEED only salts str/bytes)
        seed = hash((self.cfg.seed, stream, length, index)) % 2**63
        g = torch.Generator(device).manual_seed(seed)
        kw = dict(generator=g, device=device)
        B, P, Q = c.batch_size, c.pairs, c.queries
        context = _context_tokens(c, length == self.cfg.seqlen)
        tokens = torch.randint(0, c.num_filler, (B, length), **kw)
        # P distinct 2-token slots of the context, P distinct keys (random order), random values
        slots = torch.rand(B, context // 2, **kw).topk(P).indices
        keys = torch.rand(B, c.num_keys, **kw).topk(P).indices + self.key0
        values = torch.randint(self.value0, self.vocab_size, (B, P), **kw)
        tokens.scatter_(1, 2 * slots, keys)
        tokens.scatter_(1, 2 * slots + 1, values)
        asked = torch.rand(B, P, **kw).topk(Q).indices  # Q distinct pairs
        query_pos = (length - 2 * Q + 2 * torch.arange(Q, device=device)).expand(B, Q)
        answers = values.gather(1, asked)
        tokens.scatter_(1, query_pos, keys.gather(1, asked))
        tokens.scatter_(1, query_pos + 1, answers)
        return Batch(tokens, query_pos.contiguous(), answers, 2 * slots.gather(1, asked) + 1)


# ---------------------------------------------------------------------------------------------
# the model
# ---------------------------------------------------------------------------------------------
class AutocastMSAIndexer(MSAIndexer):
    """:class:`MSAIndexer` whose outputs take :func:`torch.autocast`'s dtype when it is on.

    Under autocast the main q/k/v leave ``nn.Linear`` in bf16, while the indexer's RMSNorm
    (fp32 weight) may promote ``q_proxy``/``k_proxy`` to fp32 (CUDA autocast runs some norms in
    fp32); :func:`flash_msa.msa_attention` takes one dtype for all five inputs.
    """

    def forward(self, hidden_states, position_ids=None, cu_seqlens=None):
        q, k = super().forward(hidden_states, position_ids=position_ids, cu_seqlens=cu_seqlens)
        device = hidden_states.device.type
        if torch.is_autocast_enabled(device):
            dtype = torch.get_autocast_dtype(device)
            q, k = q.to(dtype), k.to(dtype)
        return q, k


def _fa4():
    """FlashAttention-4's ``flash_attn_func``, or ``None`` where it is not installed."""
    try:
        from flash_attn.cute import flash_attn_func
    except Exception:  # not installed, or not for this GPU
        return None
    return flash_attn_func


class DenseAttention(nn.Module):
    """Dense causal GQA attention with :class:`MSAttention`'s projections and RoPE.

    Same submodule names (``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``, no bias) and the same
    ``RotaryEmbedding``, so an ``MSAttention`` state dict minus its ``indexer.*`` loads into it.
    ``forward(x (B, S, hidden_size)) -> (B, S, hidden_size)``.
    """

    def __init__(self, hidden_size, num_heads, num_kv_heads, rope_theta, impl="sdpa"):
        super().__init__()
        self.num_heads, self.num_key_value_heads = num_heads, num_kv_heads
        self.head_dim = hidden_size // num_heads
        C, H, Hkv, D = hidden_size, num_heads, num_kv_heads, self.head_dim
        self.q_proj = nn.Linear(C, H * D, bias=False)
        self.k_proj = nn.Linear(C, Hkv * D, bias=False)
        self.v_proj = nn.Linear(C, Hkv * D, bias=False)
        self.o_proj = nn.Linear(H * D, C, bias=False)
        self.q_norm = self.k_norm = None
        self.rotary = RotaryEmbedding(D, rope_theta)
        self.impl = impl
        self.fa4 = _fa4() if impl == "fa4" else None
        if impl == "fa4" and self.fa4 is None:
            raise ValueError("dense_impl='fa4' needs FlashAttention-4 (flash_attn.cute)")

    def forward(self, x):
        B, S, _ = x.shape
        q, k = main_qk(self, x)
        v = self.v_proj(x).view(B, S, self.num_key_value_heads, self.head_dim)
        if self.fa4 is not None:
            out = self.fa4(q, k, v, causal=True)
            out = out[0] if isinstance(out, tuple) else out
        else:
            with _sdpa_backends(x.device):
                out = F.scaled_dot_product_attention(
                    q.transpose(1, 2),
                    k.transpose(1, 2),
                    v.transpose(1, 2),
                    is_causal=True,
                    enable_gqa=self.num_heads != self.num_key_value_heads,
                ).transpose(1, 2)
        return self.o_proj(out.reshape(B, S, -1))


def main_qk(attn, x):
    """The main ``q (B, S, H, D)`` and ``k (B, S, Hkv, D)`` of an :class:`MSAttention` or a
    :class:`DenseAttention` as its forward computes them from ``x (B, S, hidden_size)``:
    projections, the optional q/k RMSNorm, RoPE at positions ``0..S-1`` (the layers' default).
    tests/integration/test_examples.py holds it to ``MSAttention``'s output."""
    B, S, _ = x.shape
    q = attn.q_proj(x).view(B, S, attn.num_heads, attn.head_dim)
    k = attn.k_proj(x).view(B, S, attn.num_key_value_heads, attn.head_dim)
    if attn.q_norm is not None:
        q, k = attn.q_norm(q), attn.k_norm(k)
    if attn.rotary is not None:
        q, k = attn.rotary(q, k, torch.arange(S, device=x.device).expand(B, S))
    return q, k


def _sdpa_backends(device):
    """On CUDA: the fused SDPA kernels only (the math path would materialize ``S x S``)."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    fused = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]
    return sdpa_kernel(fused)


class SwiGLU(nn.Module):
    def __init__(self, hidden_size, intermediate_size):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    """Pre-norm decoder layer; keeps its attention input when ``keep_attn_input`` is set (for
    the recall measurement)."""

    def __init__(self, cfg: Config, attention: str, dense_impl: str):
        super().__init__()
        C = cfg.hidden_size
        self.attn_norm = nn.RMSNorm(C, eps=1e-6)
        if attention == "msa":
            self.attn = MSAttention(
                C,
                cfg.num_heads,
                cfg.num_kv_heads,
                top_k=cfg.top_k,
                block_size=cfg.block_size,
                indexer=AutocastMSAIndexer(
                    C, cfg.num_kv_heads, cfg.proxy_head_dim, rope_theta=cfg.rope_theta
                ),
                rope_theta=cfg.rope_theta,
                warmup=True,
                kl_coeff=cfg.kl_coeff,
            )
        else:
            self.attn = DenseAttention(
                C, cfg.num_heads, cfg.num_kv_heads, cfg.rope_theta, impl=dense_impl
            )
        self.mlp_norm = nn.RMSNorm(C, eps=1e-6)
        self.mlp = SwiGLU(C, cfg.intermediate_size)
        self.conv = (
            nn.Conv1d(C, C, cfg.conv_width, groups=C, padding=cfg.conv_width - 1)
            if cfg.conv_width > 1
            else None
        )
        self.keep_attn_input = False
        self.attn_input = None

    def forward(self, x):
        h = self.attn_norm(x)
        if self.conv is not None:  # causal: output t sees inputs t - width + 1 .. t
            h = h + self.conv(h.transpose(1, 2))[..., : h.shape[1]].transpose(1, 2)
        self.attn_input = h if self.keep_attn_input else None
        out = self.attn(h)
        x = x + (out[0] if isinstance(out, tuple) else out)  # MSAttention: (output, kl)
        return x + self.mlp(self.mlp_norm(x))


class RetrievalLM(nn.Module):
    """``tokens (B, S), query_pos (B, Q) -> logits (B, Q, vocab)`` (the LM head runs at the
    query positions only: no other position has a loss)."""

    def __init__(self, cfg: Config, vocab_size: int, attention: str, dense_impl: str = "sdpa"):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, cfg.hidden_size)
        self.blocks = nn.ModuleList(Block(cfg, attention, dense_impl) for _ in range(cfg.layers))
        self.norm = nn.RMSNorm(cfg.hidden_size, eps=1e-6)
        self.lm_head = nn.Linear(cfg.hidden_size, vocab_size, bias=False)
        if cfg.tie_embeddings:
            # N(0, 1/d): the tied head's logits start O(1) (the final norm's output has norm
            # sqrt(d)); nn.Embedding's N(0, 1) gave an initial loss of 53 at d=64
            nn.init.normal_(self.embed.weight, std=cfg.hidden_size**-0.5)
            self.lm_head.weight = self.embed.weight

    def forward(self, tokens, query_pos):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        x = x.gather(1, query_pos[..., None].expand(-1, -1, x.shape[-1]))
        return self.lm_head(self.norm(x))

    def msa_layers(self) -> list[MSAttention]:
        return [b.attn for b in self.blocks if isinstance(b.attn, MSAttention)]


def build_models(cfg: Config, vocab_size: int, dense: bool, dense_impl: str):
    """``(msa_model, dense_model or None)`` with identical initial backbone weights."""
    torch.manual_seed(cfg.seed)
    msa = RetrievalLM(cfg, vocab_size, "msa")
    if not dense:
        return msa, None
    baseline = RetrievalLM(cfg, vocab_size, "dense", dense_impl)
    result = baseline.load_state_dict(msa.state_dict(), strict=False)
    if result.missing_keys or any(".indexer." not in k for k in result.unexpected_keys):
        raise RuntimeError(f"the dense model's parameters differ from the MSA model's: {result}")
    return msa, baseline


# ---------------------------------------------------------------------------------------------
# metrics
# ---------------------------------------------------------------------------------------------
@torch.no_grad()
def answer_mass(attn, x: torch.Tensor, batch: Batch, block_size: int) -> torch.Tensor:
    """The dense causal attention's probability mass on the answer's block at the query tokens.

    Args:
        attn: an :class:`MSAttention` or :class:`DenseAttention`; x: its input ``(B, S, C)``.
        batch: the batch ``x`` comes from; block_size: tokens per block.

    Returns:
        fp32 ``(B, Q, H)``: per query token and main head, the softmax over all visible keys
        (scale ``head_dim ** -0.5``, the layers' default) summed over the answer's block. For
        an MSA layer in a sparse step this is the mass dense attention would put there.
    """
    q, k = main_qk(attn, x)
    B, S, H, D = q.shape
    rows = torch.arange(B, device=x.device)[:, None]
    q = q[rows, batch.query_pos].float()  # (B, Q, H, D)
    k = k.float().repeat_interleave(H // k.shape[2], dim=2)  # (B, S, H, D)
    scores = torch.einsum("bqhd,bshd->bqhs", q, k) * D**-0.5
    pos = torch.arange(S, device=x.device)
    visible = pos <= batch.query_pos[..., None]  # (B, Q, S)
    probs = scores.masked_fill(~visible[:, :, None], float("-inf")).softmax(-1)
    in_answer = pos // block_size == (batch.answer_pos // block_size)[..., None]  # (B, Q, S)
    return (probs * in_answer[:, :, None]).sum(-1)


@torch.no_grad()
def retrieval_metrics(model: RetrievalLM, batch: Batch, autocast, block_size: int) -> dict:
    """Per layer: ``recall_layers`` (MSA only: the fraction of (sequence, query token, proxy
    head) whose ``top_k`` selection holds the answer's block) and ``answer_mass_layers`` (the
    mean of :func:`answer_mass`); for MSA also ``recall_weighted`` over all layers (the module
    docstring defines all three).

    Reads each block's kept attention input of the latest forward; call it before the
    optimizer step, so that the weights are the ones that forward used.
    """
    rows = torch.arange(batch.query_pos.shape[0], device=batch.query_pos.device)[:, None]
    recalls, masses, hit_mass, total_mass = [], [], 0.0, 0.0
    for block in model.blocks:
        attn, x = block.attn, block.attn_input
        with autocast:
            mass = answer_mass(attn, x, batch, block_size)  # (B, Q, H)
        masses.append(mass.mean().item())
        if not isinstance(attn, MSAttention):
            continue
        with autocast:
            q_proxy, k_proxy = attn.indexer(x)
        indices = flash_msa.select_blocks(
            q_proxy, k_proxy, attn.top_k, block_size=attn.block_size
        )  # (B, S, Hp, top_k)
        kept = indices[rows, batch.query_pos]  # (B, Q, Hp, top_k)
        target = (batch.answer_pos // attn.block_size)[..., None, None]
        hit = (kept == target).any(-1).float()  # (B, Q, Hp)
        recalls.append(hit.mean().item())
        group_mass = mass.unflatten(-1, (hit.shape[-1], -1)).mean(-1)  # (B, Q, Hp)
        hit_mass += (group_mass * hit).sum().item()
        total_mass += group_mass.sum().item()
    result = dict(answer_mass_layers=masses)
    if recalls:
        result.update(
            recall_layers=recalls,
            recall_weighted=hit_mass / total_mass if total_mass > 0 else None,
        )
    return result


def _mean(xs):
    return sum(xs) / len(xs)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Progress:
    """tqdm when installed; else a line on stderr about every 5% of the steps."""

    def __init__(self, total: int, desc: str, enabled: bool = True):
        self.total, self.desc, self.enabled, self.n = total, desc, enabled, 0
        self.bar = None
        if enabled:
            try:
                from tqdm.auto import tqdm
            except ImportError:
                tqdm = None
            if tqdm is not None:
                self.bar = tqdm(total=total, desc=desc, dynamic_ncols=True)
        self.every = max(1, total // 20)
        self.t0 = time.perf_counter()

    def update(self, **fields):
        self.n += 1
        text = {k: v for k, v in fields.items() if v is not None}
        if self.bar is not None:
            self.bar.set_postfix(text, refresh=False)
            self.bar.update(1)
        elif self.enabled and (self.n % self.every == 0 or self.n == self.total):
            elapsed = time.perf_counter() - self.t0
            eta = elapsed / self.n * (self.total - self.n)
            parts = "  ".join(f"{k} {v}" for k, v in text.items())
            print(
                f"[{self.desc}] {self.n}/{self.total}  {parts}  ({elapsed:.0f}s, eta {eta:.0f}s)",
                file=sys.stderr,
                flush=True,
            )

    def close(self):
        if self.bar is not None:
            self.bar.close()


# ---------------------------------------------------------------------------------------------
# training and evaluation
# ---------------------------------------------------------------------------------------------
def _autocast(cfg: Config, device):
    if cfg.dtype == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _lr_factor(cfg: Config, step: int) -> float:
    if step < cfg.lr_warmup:
        return (step + 1) / cfg.lr_warmup
    t = (step - cfg.lr_warmup) / max(1, cfg.steps - cfg.lr_warmup)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(t, 1.0)))


def train(name, model, cfg, task, device, log_path, progress=True):
    """Train ``model`` for ``cfg.steps`` steps, one JSON line per step into ``log_path``.

    Returns the list of per-step records.
    """
    model.to(device).train()
    msa_layers = model.msa_layers()
    for block in model.blocks:
        block.keep_attn_input = True
    backbone = [p for n, p in model.named_parameters() if ".indexer." not in n]
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: _lr_factor(cfg, s))
    autocast = _autocast(cfg, device)
    records = []
    bar = Progress(cfg.steps, name, progress)
    with open(log_path, "w") as log:
        for step in range(cfg.steps):
            dense_step = step < cfg.warmup_steps
            for layer in msa_layers:
                layer.warmup = dense_step
            phase = "dense" if not msa_layers else ("warmup" if dense_step else "sparse")
            length = curriculum_seqlen(cfg, step)
            batch = task.batch(RetrievalTask.TRAIN, step, device, length)
            lr = sched.get_last_lr()[0]

            _sync(device)
            t0 = time.perf_counter()
            with autocast:
                logits = model(batch.tokens, batch.query_pos)
            loss = F.cross_entropy(logits.float().flatten(0, 1), batch.answers.flatten())
            opt.zero_grad(set_to_none=True)
            loss.backward()
            _sync(device)
            elapsed = time.perf_counter() - t0

            metrics = retrieval_metrics(model, batch, autocast, cfg.block_size)

            _sync(device)
            t0 = time.perf_counter()
            torch.nn.utils.clip_grad_norm_(backbone, 1.0)
            opt.step()
            sched.step()
            _sync(device)
            elapsed += time.perf_counter() - t0

            record = dict(
                model=name,
                step=step,
                phase=phase,
                loss=loss.item(),
                acc=(logits.argmax(-1) == batch.answers).float().mean().item(),
                kl=_mean([m.last_kl.item() for m in msa_layers]) if msa_layers else None,
                recall=_mean(metrics["recall_layers"]) if msa_layers else None,
                recall_weighted=metrics.get("recall_weighted"),
                recall_layers=metrics.get("recall_layers"),
                answer_mass_layers=metrics["answer_mass_layers"],
                step_ms=elapsed * 1e3,
                lr=lr,
                seqlen=length,
                batch_size=batch.tokens.shape[0],
            )
            records.append(record)
            log.write(json.dumps(record) + "\n")
            log.flush()
            bar.update(
                S=length,
                loss=f"{record['loss']:.3f}",
                acc=f"{record['acc']:.3f}",
                kl=None if record["kl"] is None else f"{record['kl']:.3f}",
                recall=None if record["recall"] is None else f"{record['recall']:.3f}",
                ms=f"{record['step_ms']:.0f}",
            )
    bar.close()
    for block in model.blocks:
        block.keep_attn_input, block.attn_input = False, None
    return records


@torch.no_grad()
def evaluate(model, cfg, task, device, dense_attention=False):
    """Loss, accuracy and the retrieval metrics over ``cfg.eval_batches`` held-out batches at
    the full length (each metric the mean of the batches' values).

    ``dense_attention`` runs the MSA model's layers with ``warmup=True`` (dense attention)."""
    model.eval()
    for layer in model.msa_layers():
        layer.warmup = dense_attention
    for block in model.blocks:
        block.keep_attn_input = True
    autocast = _autocast(cfg, device)
    losses, accs, metrics = [], [], []
    for i in range(cfg.eval_batches):
        batch = task.batch(RetrievalTask.EVAL, i, device)
        with autocast:
            logits = model(batch.tokens, batch.query_pos)
        losses.append(F.cross_entropy(logits.float().flatten(0, 1), batch.answers.flatten()))
        accs.append((logits.argmax(-1) == batch.answers).float().mean())
        metrics.append(retrieval_metrics(model, batch, autocast, cfg.block_size))
    for block in model.blocks:
        block.keep_attn_input, block.attn_input = False, None
    model.train()
    result = dict(loss=torch.stack(losses).mean().item(), acc=torch.stack(accs).mean().item())
    for key in metrics[0]:
        if key.endswith("_layers"):
            result[key] = [_mean(layer) for layer in zip(*(m[key] for m in metrics))]
        elif all(m[key] is not None for m in metrics):
            result[key] = _mean([m[key] for m in metrics])
    if "recall_layers" in result:
        result["recall"] = _mean(result["recall_layers"])
    return result


def _median_ms(records, first_step):
    times = [r["step_ms"] for r in records if r["step"] >= first_step]
    return statistics.median(times) if times else None


def _environment(device):
    env = dict(
        python=platform.python_version(),
        torch=torch.__version__,
        flash_msa=flash_msa.__version__,
        FLASH_MSA_BACKEND=backends.requested(),
    )
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
    return env


# ---------------------------------------------------------------------------------------------
# plot
# ---------------------------------------------------------------------------------------------
def _read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def plot(out_dir: pathlib.Path, path: pathlib.Path) -> bool:
    """Loss, accuracy, KL, recall, answer mass and step time against the step, both models,
    from ``out_dir``'s JSON lines; ``False`` (and a message) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)", file=sys.stderr)
        return False
    runs = {n: _read_jsonl(out_dir / f"{n}.jsonl") for n in ("msa", "dense")}
    runs = {n: r for n, r in runs.items() if r}
    if not runs:
        print(f"no msa.jsonl or dense.jsonl in {out_dir}: no plot", file=sys.stderr)
        return False
    summary_path = out_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    colors = {"msa": "tab:blue", "dense": "tab:orange"}
    # (title, key, series): a series is (label suffix, line style, value of one record)
    mean = [("", "-", None)]
    panels = [
        ("task loss", "loss", mean),
        ("task accuracy", "acc", mean),
        ("proxy KL (mean over layers)", "kl", mean),
        ("recall of the answer's block", "recall", [("", "-", None), (" weighted", "--", "w")]),
        ("dense attention mass on the answer's block", "answer_mass_layers", []),
        ("step time (ms)", "step_ms", mean),
    ]
    any_run = next(iter(runs.values()))
    full = max(r["seqlen"] for r in any_run)
    marks = [(min(r["step"] for r in any_run if r["seqlen"] == full) - 0.5, ":")]
    warmup = [r["step"] for r in runs.get("msa", []) if r["phase"] == "warmup"]
    if warmup:
        marks.append((max(warmup) + 0.5, "--"))
    fig, axes = plt.subplots(2, 3, figsize=(15, 7.5), sharex=True)
    for ax, (title, key, series) in zip(axes.flat, panels):
        for name, records in runs.items():
            steps = [r["step"] for r in records]
            for suffix, style, which in series:
                field = "recall_weighted" if which == "w" else key
                values = [r.get(field) for r in records]
                if any(v is not None for v in values):
                    ax.plot(steps, values, color=colors[name], ls=style, lw=1, label=name + suffix)
            per_layer = key in ("recall", "answer_mass_layers")
            layers_key = "recall_layers" if key == "recall" else key
            if per_layer and records[0].get(layers_key) is not None:
                for layer, values in enumerate(zip(*(r[layers_key] for r in records))):
                    ax.plot(
                        steps,
                        values,
                        color=colors[name],
                        ls=((0, (1, 1)), "-.", (0, (3, 1, 1, 1)), ":")[layer % 4]
                        if key == "recall"
                        else ("-", "--", "-.", ":")[layer % 4],
                        lw=0.7,
                        label=f"{name} layer {layer}",
                    )
        for x, style in marks:
            ax.axvline(x, color="gray", ls=style, lw=0.8)
        ax.set_title(title, fontsize=10)
        if key in ("loss", "step_ms"):
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in axes[1]:
        ax.set_xlabel("step (dotted: full length from here; dashed: MSA sparse from here)")
    cfg = summary.get("config", {})
    times = summary.get("step_ms_sparse_phase", {})
    title = (
        f"long-range retrieval: S={cfg.get('seqlen', full)}, top_k={cfg.get('top_k', '?')} "
        f"blocks of {cfg.get('block_size', '?')}"
    )
    if times.get("msa") and times.get("dense"):
        title += f"; median step {times['msa']:.1f} ms (MSA) vs {times['dense']:.1f} ms (dense)"
    final = summary.get("final_eval", {})
    if "acc" in final.get("msa", {}) and "acc" in final.get("dense", {}):
        title += f"; held-out accuracy {final['msa']['acc']:.3f} vs {final['dense']['acc']:.3f}"
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")
    return True


# ---------------------------------------------------------------------------------------------
# command line
# ---------------------------------------------------------------------------------------------
def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    p.add_argument("--tiny", action="store_true", help="CPU smoke preset (1024 tokens, seconds)")
    p.add_argument("--out", default="runs/long_retrieval", help="output folder")
    p.add_argument("--plot", default=None, help="write the plot to this file (needs matplotlib)")
    p.add_argument("--plot-only", action="store_true", help="only redraw --plot from --out")
    p.add_argument(
        "--msa",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="train the MSA model (default: yes)",
    )
    p.add_argument(
        "--dense-baseline",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also train the dense-attention model (default: yes)",
    )
    p.add_argument("--dense-impl", choices=("sdpa", "fa4"), default="sdpa")
    p.add_argument(
        "--backend",
        choices=backends.CHOICES,
        default=None,
        help="flash-msa backend (default: torch on CPU, else FLASH_MSA_BACKEND or auto)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    for f in dataclasses.fields(Config):  # --seqlen, --warmup-steps, ... (None: the preset's)
        flag = "--" + f.name.replace("_", "-")
        kind = str(f.type).split(" ")[0]  # the annotation's text ("int | None" -> "int")
        if kind == "bool":
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=None)
        else:
            types = {"int": int, "float": float, "str": str}
            p.add_argument(flag, type=types[kind], default=None, help=f"(default {f.default})")
    return p.parse_args(argv)


def make_config(args) -> Config:
    values = dict(TINY) if args.tiny else {}
    if args.device is not None and args.device.startswith("cpu") and not args.tiny:
        values["dtype"] = "fp32"  # the torch backend's bf16 on CPU is slow and pointless here
    for f in dataclasses.fields(Config):
        given = getattr(args, f.name)
        if given is not None:
            values[f.name] = given
    return Config(**values).resolved()


def _summary(out: pathlib.Path, cfg: Config) -> dict:
    """The run's summary: ``OUT/summary.json`` when it holds this configuration (so that the
    models can be trained by separate commands), else a new one."""
    path = out / "summary.json"
    if path.exists():
        old = json.loads(path.read_text())
        if old.get("config") == dataclasses.asdict(cfg):
            return old
        print(f"{path} holds another configuration: replaced", file=sys.stderr)
    return dict(config=dataclasses.asdict(cfg), final_eval={}, step_ms_sparse_phase={})


def main(argv=None):
    args = parse_args(argv)
    out = pathlib.Path(args.out)
    if args.plot_only:
        if args.plot is None:
            raise SystemExit("--plot-only needs --plot FILE")
        return 0 if plot(out, pathlib.Path(args.plot)) else 1
    if not (args.msa or args.dense_baseline):
        raise SystemExit("--no-msa and --no-dense-baseline: nothing to train")
    try:
        cfg = make_config(args)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    backend = args.backend or ("torch" if device.type == "cpu" else backends.requested())
    out.mkdir(parents=True, exist_ok=True)
    task = RetrievalTask(cfg)
    msa_model, dense_model = build_models(
        cfg, task.vocab_size, args.dense_baseline, args.dense_impl
    )
    n_params = sum(p.numel() for p in msa_model.parameters())
    n_proxy = sum(p.numel() for n, p in msa_model.named_parameters() if ".indexer." in n)
    print(
        f"long-range retrieval: S={cfg.seqlen} B={cfg.batch_size} pairs={cfg.pairs} "
        f"queries={cfg.queries} vocab={task.vocab_size}; {cfg.layers} layers, d={cfg.hidden_size}"
        f", {n_params / 1e6:.2f}M parameters ({n_proxy / 1e6:.2f}M in indexers); top_k="
        f"{cfg.top_k} x {cfg.block_size} of {math.ceil(cfg.seqlen / cfg.block_size)} blocks; "
        f"{cfg.curriculum_steps} curriculum steps from {cfg.min_seqlen} tokens, "
        f"{cfg.warmup_steps} dense warmup + {cfg.steps - cfg.warmup_steps} sparse steps; "
        f"{device}, {cfg.dtype}, backend {backend}"
    )
    first_timed = cfg.warmup_steps + 5  # the sparse phase; its first steps compile kernels
    summary = _summary(out, cfg)
    summary.update(
        environment=_environment(device),
        parameters=n_params,
        indexer_parameters=n_proxy,
        timed_from_step=first_timed,
    )
    runs = [("msa", msa_model)] if args.msa else []
    if dense_model is not None:
        runs.append(("dense", dense_model))
        summary["dense_impl"] = args.dense_impl
    with backends.forced(backend):
        summary["environment"]["FLASH_MSA_BACKEND"] = backends.requested()
        for name, model in runs:
            records = train(
                name, model, cfg, task, device, out / f"{name}.jsonl", not args.no_progress
            )
            final = evaluate(model, cfg, task, device)
            if name == "msa":
                final["dense_attention"] = evaluate(model, cfg, task, device, dense_attention=True)
            summary["final_eval"][name] = final
            summary["step_ms_sparse_phase"][name] = _median_ms(records, first_timed)
            shown = ("step", "seqlen", "phase", "loss", "acc", "kl", "recall", "step_ms")
            print(f"{name} last step: {json.dumps({k: records[-1][k] for k in shown})}")
            print(f"{name} final eval: {json.dumps(final)}")
            model.cpu()  # free the device for the next run
    times = summary["step_ms_sparse_phase"]
    if times.get("msa") and times.get("dense"):
        summary["msa_speedup"] = times["dense"] / times["msa"]
        print(
            f"median step from step {first_timed}: msa {times['msa']:.1f} ms, dense "
            f"{times['dense']:.1f} ms ({summary['msa_speedup']:.2f}x)"
        )
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"wrote {', '.join(str(out / f'{name}.jsonl') for name, _ in runs)}, {out}/summary.json")
    if args.plot is not None:
        plot(out, pathlib.Path(args.plot))
    return 0


if __name__ == "__main__":
    sys.exit(main())
