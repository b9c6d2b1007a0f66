"""Train a byte-level decoder LM on real source text: MSA (dense warmup, then sparse) or dense.

Run it twice with the same seed, ``--attn dense`` and ``--attn msa``: both runs start from the
same weights (every shared parameter is drawn from a generator keyed by its name, so the MSA
model's extra indexer parameters shift nothing) and see the same batches (an order drawn from
``--seed`` alone; ``steps.jsonl`` records each step's sequence numbers). Then
``examples/plot_training.py`` draws both.

Model (``ModelConfig``; the defaults have 97.0M parameters, 100.2M with the MSA indexers): byte
vocabulary (256), pre-norm decoder layers ``x = x + attn(RMSNorm(x))``, ``x = x +
SwiGLU(RMSNorm(x))``, a final RMSNorm and an untied LM head; GQA with ``head_dim`` 128 and RoPE
(``rope_theta`` 1e6, a long-context base). The attention layers, the SwiGLU MLP and the
autocast-aware indexer are those of examples/train_long_retrieval.py, imported from it (this folder
is on ``sys.path`` when the script runs).

- ``--attn msa``: every attention layer is a :class:`flash_msa.nn.MSAttention` with an indexer of
  the MSA paper's shape (one proxy head per KV group, one proxy key head, ``proxy_head_dim``
  128, q/k RMSNorm and RoPE, detached input). The first ``--warmup-steps`` steps run it with
  ``warmup=True`` (dense attention; the KL over every visible key trains the proxy), the rest
  sparse (``top_k`` 16 blocks of 128 tokens per query). The KL reaches the loss as docs/nn.md
  says, through ``kl_coeff`` (1.0): ``loss.backward()`` gives the gradients of
  ``lm_loss + kl_coeff * sum over layers of KL``; with the detached indexer input only the
  indexers see that term.
- ``--attn dense``: the same layers with dense causal attention: FlashAttention-4
  (``flash_attn.cute.flash_attn_func``) where it imports on a GPU, else
  ``F.scaled_dot_product_attention(is_causal=True)`` restricted on CUDA to its fused kernels.

Precision: fp32 master weights and fp32 AdamW state, bf16 autocast for the matrix work on a
GPU (``--dtype bf16``, the default there); fp32 throughout on CPU. AdamW is fused on CUDA
(betas 0.9/0.95, weight decay 0.1 on matrices), with a linear LR warmup (``--lr-warmup-steps``)
and a cosine decay to 10 % of ``--lr`` at ``--steps``. Gradients are clipped to norm 1.0, the
backbone (the parameters both models share) and the indexers separately, so the KL's gradients
never change how the backbone is clipped and both runs clip alike.

Data (:func:`build_corpus`): the ``*.py`` files of the Python standard library
(``sysconfig.get_paths()["stdlib"]``, without its site-packages) and of the installed packages
(``site.getsitepackages()``), read as bytes: real text by many authors, present on every machine
that runs this script, no download needed. Walked in sorted order; a file's package is its top-level
directory (the top-level single-file modules of a root form one package), and the files of a package
are concatenated in path order with a NUL byte between them, so that a 32K-token sequence mostly
holds related files. Reading stops once ``--corpus-mb`` is reached (at a file boundary). A file goes
to the held-out split when a stable hash of its path (root label and relative path) falls in the
first ``--test-fraction`` (2 %) of the hash range, so the split is by document and the same on every
run. Train sequences are the stream cut into ``seq_len`` windows (targets shifted by one byte),
taken in a random order per epoch drawn from ``--seed``; held-out sequences are the test stream's
windows in a fixed order.

Outputs under ``--out``:

- ``steps.jsonl``: one line per step: ``step``, ``phase`` (``dense``/``warmup``/``sparse``),
  ``loss`` (nats per byte), ``kl`` (mean over layers; ``null`` for dense), ``step_seconds``
  (forward, backward and optimizer, synchronized), ``tokens`` (this step's), ``tokens_total``,
  ``lr``, ``grad_norm``, ``chunks`` (the train sequences of the batch), and every ``--eval-every``
  steps ``heldout_loss`` (over ``--eval-every-batches`` held-out sequences).
- ``summary.json``: the configuration, parameter counts, tokens trained, corpus size, the held-out
  loss overall and by position (buckets 0-1K, 1-4K, 4-16K, 16-32K, and 32 equal bins), the median
  step time per phase, and for MSA: the held-out loss with each ``selection_precision`` (``bf16``,
  ``fp8``) and with dense attention on the same weights; per layer, over ``--recall-batches``
  held-out sequences, the proxy's recall and covered attention mass against the oracle selection
  (the ``top_k`` blocks of most main attention mass) and the fp8 selection's recall and covered
  mass against the exact selection (:mod:`flash_msa.recall`'s metrics), and ``fp8_gate``: the
  fp8 selection against its quality gate (covered mass >= 99.5 % of the exact
  selection's in every layer, held-out loss within 0.2 % of the bf16-selected model's). A mode the
  backend in use cannot run is reported with its error instead of numbers.

``--save CKPT`` writes the model, the optimizer state and the step count after training (also
when ``--max-train-seconds`` stops it early; ``--stop-step`` ends another run at the same step
on the same schedule); ``--load CKPT`` resumes training from it, or with
``--eval-only`` evaluates it in a separate invocation (``--train-only`` skips the final
evaluation). ``--tiny`` is a CPU configuration (tiny model, 512-byte sequences, 64-token blocks,
the torch backend, one CPU thread) that runs in seconds; tests/integration/test_train_real_text.py runs it.

A comparison on one GPU, one invocation per command. ``--max-train-seconds T`` stops the MSA
run if it would outlast its time limit (it then saves and evaluates what it has), and
``--stop-step M``, with M its summary's ``steps_done``, cuts the dense run at the same step::

    python examples/train_real_text.py --attn msa --steps N --warmup-steps W --out runs/msa
    python examples/train_real_text.py --attn dense --steps N --out runs/dense --stop-step M
    python examples/plot_training.py runs/dense runs/msa --out runs/plot.svg
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import math
import os
import pathlib
import platform
import site
import statistics
import sys
import sysconfig
import time

import torch
import torch.nn.functional as F
from torch import nn

import flash_msa
from flash_msa import recall, select_blocks
from flash_msa.nn import MSAttention

# the sibling example's layers (this folder is on sys.path when the script runs)
from train_long_retrieval import (
    AutocastMSAIndexer,
    DenseAttention,
    SwiGLU,
    _fa4,
    _sync,
    main_qk,
)

VOCAB = 256
DOC_SEPARATOR = b"\x00"
BUCKET_EDGES = (0, 1024, 4096, 16384, 32768, 65536, 131072)  # loss-by-position buckets
POSITION_BINS = 32  # equal-width position bins of the finer held-out curve
PRECISIONS = ("bf16", "fp8")  # the exact selection first, then the approximate one
SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    hidden_size: int = 1024
    layers: int = 8
    heads: int = 8  # head_dim = hidden_size / heads (128)
    kv_heads: int = 2
    intermediate_size: int = 3072
    rope_theta: float = 1e6
    top_k: int = 16
    block_size: int = 128
    proxy_head_dim: int = 128
    kl_coeff: float = 1.0


# run settings that --tiny changes (ModelConfig fields and run arguments)
DEFAULTS = dict(
    seq_len=32768,
    batch=1,
    steps=1000,
    lr=6e-4,
    lr_warmup_steps=50,
    warmup_steps=100,
    eval_batches=8,
    eval_every=100,
    eval_every_batches=2,
    recall_batches=2,
    corpus_mb=256.0,
    sources="stdlib,site",
)
TINY = dict(
    hidden_size=64,
    layers=2,
    heads=2,
    kv_heads=1,
    intermediate_size=128,
    top_k=2,
    block_size=64,
    proxy_head_dim=32,
    seq_len=512,
    batch=2,
    steps=24,
    lr=3e-3,
    lr_warmup_steps=4,
    warmup_steps=8,
    eval_batches=2,
    eval_every=8,
    eval_every_batches=1,
    recall_batches=1,
    corpus_mb=1.5,
    sources="stdlib",
)


# ---------------------------------------------------------------------------------------------
# data
# ---------------------------------------------------------------------------------------------
def source_roots(sources: str) -> list[tuple[str, pathlib.Path]]:
    """``(label, root)`` of each source: ``stdlib`` and ``site`` (each site-packages folder)."""
    roots = []
    for name in sources.split(","):
        name = name.strip()
        if name == "stdlib":
            roots.append(("stdlib", pathlib.Path(sysconfig.get_paths()["stdlib"])))
        elif name == "site":
            for i, path in enumerate(sorted(set(site.getsitepackages()))):
                roots.append((f"site{i}" if i else "site", pathlib.Path(path)))
        else:
            raise ValueError(f"--sources takes stdlib and/or site, got {name!r}")
    return [(label, root) for label, root in roots if root.is_dir()]


def walk_sources(roots):
    """``(label, package, relpath, path)`` of every ``*.py`` file, in sorted order: roots in the
    given order, then sorted directory walk (site-packages folders inside the stdlib left out,
    they are sources of their own)."""
    for label, root in roots:
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
            for name in sorted(filenames):
                if not name.endswith(".py"):
                    continue
                path = pathlib.Path(dirpath, name)
                rel = path.relative_to(root).as_posix()
                package = rel.split("/")[0] if "/" in rel else "<top-level>"
                yield label, package, rel, path


def is_test_document(label: str, relpath: str, test_fraction: float) -> bool:
    """The held-out split: a stable hash of the document's path (not Python's ``hash``, which
    is salted per process)."""
    digest = hashlib.blake2b(f"{label}/{relpath}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2.0**64 < test_fraction


def build_corpus(sources: str, max_bytes: int, test_fraction: float) -> dict:
    """The train and held-out byte streams (uint8 tensors) and their statistics.

    Each stream is the concatenation of its packages in walk order; within a package the files
    in path order, each followed by :data:`DOC_SEPARATOR`."""
    t0 = time.perf_counter()
    roots = source_roots(sources)
    streams = {"train": [], "test": []}
    files = {"train": 0, "test": 0}
    packages = set()
    total = 0
    for label, package, rel, path in walk_sources(roots):
        if total >= max_bytes:
            break
        try:
            data = path.read_bytes()
        except OSError:
            continue
        if not data:
            continue
        split = "test" if is_test_document(label, rel, test_fraction) else "train"
        streams[split].append(data + DOC_SEPARATOR)
        files[split] += 1
        packages.add((label, package))
        total += len(data) + 1
    out = {}
    for split, parts in streams.items():
        blob = bytearray(b"".join(parts))
        empty = torch.empty(0, dtype=torch.uint8)
        out[split] = torch.frombuffer(blob, dtype=torch.uint8) if blob else empty
    out["stats"] = dict(
        sources=[f"{label}:{root}" for label, root in roots],
        bytes_train=out["train"].numel(),
        bytes_test=out["test"].numel(),
        files_train=files["train"],
        files_test=files["test"],
        packages=len(packages),
        max_bytes=max_bytes,
        test_fraction=test_fraction,
        read_seconds=round(time.perf_counter() - t0, 2),
    )
    return out


def load_corpus(args) -> dict:
    """:func:`build_corpus`, or its copy in ``--corpus-cache`` when that was built alike."""
    key = dict(
        sources=args.sources,
        max_bytes=int(args.corpus_mb * 2**20),
        test_fraction=args.test_fraction,
        roots=[str(r) for _, r in source_roots(args.sources)],
    )
    cache = pathlib.Path(args.corpus_cache) if args.corpus_cache else None
    if cache is not None and cache.exists():
        saved = torch.load(cache, weights_only=True)
        if saved.get("key") == json.dumps(key, sort_keys=True):
            saved["stats"] = json.loads(saved["stats"])
            saved["stats"]["cached"] = True
            return saved
    corpus = build_corpus(args.sources, key["max_bytes"], args.test_fraction)
    if cache is not None:
        cache.parent.mkdir(parents=True, exist_ok=True)
        torch.save(
            dict(
                key=json.dumps(key, sort_keys=True),
                train=corpus["train"],
                test=corpus["test"],
                stats=json.dumps(corpus["stats"]),
            ),
            cache,
        )
    return corpus


class Batches:
    """Train and held-out windows of ``seq_len`` bytes, targets shifted by one.

    Train order: epoch ``e`` is ``randperm(windows)`` drawn from ``(seed, e)``; step ``s`` takes
    the next ``batch`` windows of that order. Held-out: a fixed order of the test windows."""

    def __init__(self, corpus: dict, seq_len: int, batch: int, seed: int, device):
        self.seq_len, self.batch, self.seed, self.device = seq_len, batch, seed, device
        self.train = corpus["train"].to(device)
        self.test = corpus["test"].to(device)
        self.train_windows = (self.train.numel() - 1) // seq_len
        self.test_windows = (self.test.numel() - 1) // seq_len
        if self.train_windows < batch:
            raise ValueError(
                f"the train split has {self.train_windows} windows of {seq_len} bytes, fewer "
                f"than --batch {batch}; raise --corpus-mb"
            )
        if self.test_windows < 1:
            raise ValueError(
                f"the held-out split has no window of {seq_len} bytes; raise --corpus-mb or "
                "--test-fraction"
            )
        g = torch.Generator().manual_seed(seed + 7919)
        self.test_order = torch.randperm(self.test_windows, generator=g).tolist()
        self._epochs = {}

    def _order(self, epoch: int) -> list[int]:
        if epoch not in self._epochs:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._epochs = {epoch: torch.randperm(self.train_windows, generator=g).tolist()}
        return self._epochs[epoch]

    def train_chunks(self, step: int) -> list[int]:
        per_epoch = self.train_windows // self.batch
        order = self._order(step // per_epoch)
        i = (step % per_epoch) * self.batch
        return order[i : i + self.batch]

    def _windows(self, stream, chunks):
        S = self.seq_len
        idx = torch.tensor(chunks, device=self.device)[:, None] * S
        idx = idx + torch.arange(S + 1, device=self.device)
        w = stream[idx].long()
        return w[:, :-1], w[:, 1:]

    def train_batch(self, step: int):
        chunks = self.train_chunks(step)
        return chunks, *self._windows(self.train, chunks)

    def heldout(self, n: int):
        """The first ``n`` held-out windows (fewer if the split has fewer), one at a time."""
        for c in self.test_order[:n]:
            yield self._windows(self.test, [c])


# ---------------------------------------------------------------------------------------------
# model
# ---------------------------------------------------------------------------------------------
class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, attn: str, dense_impl: str):
        super().__init__()
        C = cfg.hidden_size
        self.attn_norm = nn.RMSNorm(C, eps=1e-6)
        if attn == "msa":
            self.attn = MSAttention(
                C,
                cfg.heads,
                cfg.kv_heads,
                top_k=cfg.top_k,
                block_size=cfg.block_size,
                indexer=AutocastMSAIndexer(
                    C, cfg.kv_heads, cfg.proxy_head_dim, rope_theta=cfg.rope_theta
                ),
                rope_theta=cfg.rope_theta,
                warmup=True,
                kl_coeff=cfg.kl_coeff,
            )
        else:
            self.attn = DenseAttention(C, cfg.heads, cfg.kv_heads, cfg.rope_theta, dense_impl)
        self.mlp_norm = nn.RMSNorm(C, eps=1e-6)
        self.mlp = SwiGLU(C, cfg.intermediate_size)

    def forward(self, x):
        out = self.attn(self.attn_norm(x))
        x = x + (out[0] if isinstance(out, tuple) else out)  # MSAttention: (output, kl)
        return x + self.mlp(self.mlp_norm(x))


class ByteLM(nn.Module):
    """``tokens (B, S) int64 -> logits (B, S, 256)``."""

    def __init__(self, cfg: ModelConfig, attn: str, dense_impl: str = "sdpa"):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(VOCAB, cfg.hidden_size)
        self.blocks = nn.ModuleList(Block(cfg, attn, dense_impl) for _ in range(cfg.layers))
        self.norm = nn.RMSNorm(cfg.hidden_size, eps=1e-6)
        self.lm_head = nn.Linear(cfg.hidden_size, VOCAB, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.norm(x))

    def msa_layers(self) -> list[MSAttention]:
        return [m for m in self.modules() if isinstance(m, MSAttention)]


def is_indexer(name: str) -> bool:
    return ".indexer." in name


def init_weights(model: nn.Module, seed: int) -> None:
    """Every parameter from a CPU generator keyed by ``(seed, name)``: the same values for a
    name in any model and on any device. Norm weights 1; matrices N(0, 0.02), the residual
    branches' output projections N(0, 0.02 / sqrt(2 * layers)) (GPT-2's scaling)."""
    layers = model.cfg.layers
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.fill_(1.0)
                continue
            key = int.from_bytes(hashlib.blake2b(name.encode(), digest_size=4).digest(), "little")
            g = torch.Generator().manual_seed(seed * 2**32 + key)
            std = 0.02
            if name.endswith(("o_proj.weight", "down_proj.weight")) and not is_indexer(name):
                std /= math.sqrt(2 * layers)
            p.copy_(torch.randn(p.shape, generator=g) * std)


def checksum(model: nn.Module) -> float:
    """Sum of |p| over the backbone (the parameters both models share): equal at step 0."""
    with torch.no_grad():
        return sum(
            p.double().abs().sum().item()
            for n, p in model.named_parameters()
            if not is_indexer(n)
        )


# ---------------------------------------------------------------------------------------------
# training
# ---------------------------------------------------------------------------------------------
def _autocast(args, device):
    if args.dtype == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def lr_factor(step: int, steps: int, warmup: int) -> float:
    if step < warmup:
        return (step + 1) / warmup
    t = (step - warmup) / max(1, steps - warmup)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(t, 1.0)))


def make_optimizer(model, args, device):
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (decay if p.dim() >= 2 and name != "embed.weight" else no_decay).append(p)
    groups = [dict(params=decay, weight_decay=0.1), dict(params=no_decay, weight_decay=0.0)]
    fused = {"fused": True} if device.type == "cuda" else {}
    return torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), eps=1e-8, **fused)


def lm_losses(model, x, y, autocast):
    """Per-token cross entropy ``(B, S)`` in fp32."""
    with autocast:
        logits = model(x)
    return F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="none").view(
        y.shape
    )


def set_mode(model, warmup: bool, precision: str = "bf16"):
    for layer in model.msa_layers():
        layer.warmup = warmup
        layer.selection_precision = precision


def phase_of(model, step, warmup_steps):
    if not model.msa_layers():
        return "dense"
    return "warmup" if step < warmup_steps else "sparse"


@torch.no_grad()
def quick_heldout(model, data, n, autocast, was_training=True):
    model.eval()
    losses = [lm_losses(model, x, y, autocast).mean() for x, y in data.heldout(n)]
    model.train(was_training)
    return torch.stack(losses).mean().item()


def train(model, data, args, device, out: pathlib.Path, state: dict, t_start: float) -> dict:
    """Train from ``state["step"]`` to ``args.steps`` (or until ``--max-train-seconds``), one
    JSON line per step into ``out / "steps.jsonl"``; returns the updated ``state``."""
    opt = make_optimizer(model, args, device)
    if state.get("optimizer") is not None:
        opt.load_state_dict(state["optimizer"])
    start = state["step"]
    state["stopped_early"] = False
    backbone = [p for n, p in model.named_parameters() if not is_indexer(n)]
    indexers = [p for n, p in model.named_parameters() if is_indexer(n)]
    autocast = _autocast(args, device)
    model.train()
    mode = "a" if start > 0 else "w"
    tokens_total = state["tokens_total"]
    with open(out / "steps.jsonl", mode) as log:
        end = min(args.steps, args.stop_step or args.steps)
        for step in range(start, end):
            if args.max_train_seconds and time.perf_counter() - t_start > args.max_train_seconds:
                state["stopped_early"] = True
                print(f"stopping at step {step}: --max-train-seconds reached", file=sys.stderr)
                break
            phase = phase_of(model, step, args.warmup_steps)
            set_mode(model, warmup=phase == "warmup")
            chunks, x, y = data.train_batch(step)
            lr = args.lr * lr_factor(step, args.steps, args.lr_warmup_steps)
            for group in opt.param_groups:
                group["lr"] = lr
            _sync(device)
            t0 = time.perf_counter()
            loss = lm_losses(model, x, y, autocast).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(backbone, 1.0)
            if indexers:
                torch.nn.utils.clip_grad_norm_(indexers, 1.0)
            opt.step()
            _sync(device)
            seconds = time.perf_counter() - t0

            layers = model.msa_layers()
            tokens = x.numel()
            tokens_total += tokens
            record = dict(
                step=step,
                phase=phase,
                loss=loss.item(),
                kl=statistics.fmean(m.last_kl.item() for m in layers) if layers else None,
                step_seconds=seconds,
                tokens=tokens,
                tokens_total=tokens_total,
                lr=lr,
                grad_norm=grad_norm.item(),
                chunks=chunks,
            )
            last = step == end - 1
            if args.eval_every and ((step + 1) % args.eval_every == 0 or last):
                record["heldout_loss"] = quick_heldout(
                    model, data, args.eval_every_batches, autocast
                )
            log.write(json.dumps(record) + "\n")
            log.flush()
            state["step"] = step + 1
            if step % max(1, args.steps // 50) == 0 or last:
                extra = "" if record["kl"] is None else f"  kl {record['kl']:.4f}"
                held = record.get("heldout_loss")
                extra += "" if held is None else f"  heldout {held:.4f}"
                print(
                    f"[{args.attn}] step {step} {phase}  loss {record['loss']:.4f}{extra}  "
                    f"{seconds * 1e3:.0f} ms  ({time.perf_counter() - t_start:.0f}s)",
                    file=sys.stderr,
                    flush=True,
                )
    state["tokens_total"] = tokens_total
    state["optimizer"] = opt.state_dict()
    return state


# ---------------------------------------------------------------------------------------------
# evaluation
# ---------------------------------------------------------------------------------------------
def bucket_edges(seq_len: int):
    """``(name, lo, hi)`` of the position buckets that start inside the sequence."""
    edges = [e for e in BUCKET_EDGES if e < seq_len] + [seq_len]
    out = []
    for lo, hi in zip(edges[:-1], edges[1:]):
        i = BUCKET_EDGES.index(lo) + 1
        nominal = BUCKET_EDGES[i] if i < len(BUCKET_EDGES) else hi
        out.append((f"{lo // 1024}-{nominal // 1024}K", lo, hi))
    return out


@torch.no_grad()
def heldout_loss(model, data, n, autocast) -> dict:
    """Mean held-out loss over ``n`` sequences: overall, per position bucket and per bin."""
    model.eval()
    S = data.seq_len
    pos_sum = torch.zeros(S, dtype=torch.float64, device=data.device)
    count = 0
    for x, y in data.heldout(n):
        pos_sum += lm_losses(model, x, y, autocast).double().sum(0)
        count += x.shape[0]
    per_pos = (pos_sum / count).cpu()
    bins = None
    if S % POSITION_BINS == 0:
        bins = per_pos.view(POSITION_BINS, S // POSITION_BINS).mean(1)
    return dict(
        loss=per_pos.mean().item(),
        bits_per_byte=per_pos.mean().item() / math.log(2),
        buckets={name: per_pos[lo:hi].mean().item() for name, lo, hi in bucket_edges(S)},
        bins=None if bins is None else bins.tolist(),
        bin_tokens=S // POSITION_BINS,
        sequences=count,
    )


def oracle_selection(mass, Hp, top_k, block_size):
    """int32 ``(T, Hp, top_k)``: per proxy head the ``top_k`` visible blocks of most main
    attention mass (group mean over its main heads), own block always kept, -1 padded."""
    H, T, nb = mass.shape
    g = mass.view(Hp, H // Hp, T, nb).mean(1).permute(1, 0, 2)  # (T, Hp, nb)
    own = torch.arange(T, device=mass.device) // block_size
    blocks = torch.arange(nb, device=mass.device)
    score = g.masked_fill(blocks[None, None, :] > own[:, None, None], -1.0)
    score = score.scatter(2, own[:, None, None].expand(T, Hp, 1), 2.0)  # mass <= 1 < 2
    k = min(top_k, nb)
    val, idx = score.topk(k, dim=-1)
    idx = torch.where(val < 0, -1, idx).to(torch.int32)
    if k < top_k:
        idx = F.pad(idx, (0, top_k - k), value=-1)
    return idx.sort(-1).values


def covered_fraction(idx, mass, Hp, top_k, block_size) -> float:
    """Mean over the rows with a choice (more visible blocks than ``top_k``) and proxy heads of
    the group's attention mass in the selected blocks plus the own block (1.0 = all of it)."""
    H, T, nb = mass.shape
    rows = torch.arange(T, device=mass.device) // block_size + 1 > top_k
    if not bool(rows.any()):
        return float("nan")
    g = mass.view(Hp, H // Hp, T, nb).mean(1).permute(1, 0, 2)  # (T, Hp, nb)
    sel = torch.zeros(T, Hp, nb + 1, dtype=torch.bool, device=mass.device)
    sel.scatter_(2, torch.where(idx < 0, nb, idx.long()), True)
    own = (torch.arange(T, device=mass.device) // block_size)[:, None, None].expand(T, Hp, 1)
    sel.scatter_(2, own, True)
    return (sel[..., :nb] * g)[rows].sum(-1).mean().item()


def _mean_dicts(dicts):
    keys = dicts[0].keys()
    return {k: statistics.fmean(d[k] for d in dicts) for k in keys}


@torch.no_grad()
def selection_metrics(model, data, n, autocast) -> dict:
    """Per layer, over ``n`` held-out sequences of the sparse model: the proxy selection
    against the oracle (``recall``, ``exact_rows``, ``mass_ratio`` of :mod:`flash_msa.recall`
    plus the absolute covered mass of each), and each fp8 mode against the exact selection.

    The layer inputs are caught by forward pre-hooks; q, k and the proxies are recomputed from
    them as the layers compute them. :func:`flash_msa.recall.block_mass` and
    :func:`flash_msa.recall.selection_metrics` build their work tensors on the default device,
    so they run under ``torch.device`` of the data (on a GPU there, not on the host)."""
    model.eval()
    set_mode(model, warmup=False)
    layers = model.msa_layers()
    inputs = {}
    hooks = [
        layer.register_forward_pre_hook(lambda m, a, i=i: inputs.__setitem__(i, a[0]))
        for i, layer in enumerate(layers)
    ]
    per_layer = [{"proxy": [], **{p: [] for p in PRECISIONS[1:]}} for _ in layers]
    errors = {}
    try:
        for x, _ in data.heldout(n):
            with autocast:
                model(x)
            for i, layer in enumerate(layers):
                h = inputs[i]
                with autocast:
                    q, k = main_qk(layer, h)
                    qp, kp = layer.indexer(h)
                bs, top_k = layer.block_size, layer.top_k
                Hp = qp.shape[-2]
                exact = select_blocks(qp, kp, top_k, block_size=bs)[0]
                with torch.device(data.device):
                    cu = torch.tensor([0, q.shape[1]], dtype=torch.int32)
                    mass = recall.block_mass(q[0], k[0], cu, bs, layer.head_dim**-0.5)
                    oracle = oracle_selection(mass, Hp, top_k, bs)
                    m = recall.selection_metrics(exact, oracle, mass, top_k, bs)
                    m["covered_mass"] = covered_fraction(exact, mass, Hp, top_k, bs)
                    m["oracle_covered_mass"] = covered_fraction(oracle, mass, Hp, top_k, bs)
                    per_layer[i]["proxy"].append(m)
                    for p in PRECISIONS[1:]:
                        if p in errors:
                            continue
                        try:
                            idx = select_blocks(qp, kp, top_k, block_size=bs, selection_precision=p)
                        except Exception as e:  # a mode the backend in use does not run
                            errors[p] = f"{type(e).__name__}: {e}"
                            continue
                        m = recall.selection_metrics(idx[0], exact, mass, top_k, bs)
                        m["covered_mass"] = covered_fraction(idx[0], mass, Hp, top_k, bs)
                        per_layer[i][p].append(m)
                del mass
            inputs.clear()
    finally:
        for hk in hooks:
            hk.remove()
    result = {"proxy_vs_oracle": [_mean_dicts(d["proxy"]) for d in per_layer]}
    for p in PRECISIONS[1:]:
        result[f"{p}_vs_exact"] = (
            {"error": errors[p]} if p in errors else [_mean_dicts(d[p]) for d in per_layer]
        )
    return result


# the fp8 selection's quality gate: covered mass >= 99.5 % of the exact selection's (the lowest
# layer), held-out loss within 0.2 % of the bf16-selected model's
FP8_GATE = dict(min_mass_ratio=0.995, max_loss_rel=0.002)


def fp8_gate(by_precision: dict, selection: dict) -> dict:
    """Each fp8 mode against :data:`FP8_GATE`: the covered mass relative to the exact
    selection's (the lowest layer's) and the held-out loss relative to the bf16-selected one,
    overall and in the worst bucket."""
    out = {}
    base = by_precision.get("bf16", {})
    for p in PRECISIONS[1:]:
        res, sel = by_precision.get(p, {}), selection.get(f"{p}_vs_exact")
        if "loss" not in res or "loss" not in base or not isinstance(sel, list):
            out[p] = {"error": res.get("error") or (sel or {}).get("error") or "not measured"}
            continue
        rel = {b: res["buckets"][b] / base["buckets"][b] - 1 for b in base["buckets"]}
        entry = dict(
            min_mass_ratio=min(m["mass_ratio"] for m in sel),
            mean_recall=statistics.fmean(m["recall"] for m in sel),
            loss_rel=res["loss"] / base["loss"] - 1,
            worst_bucket_loss_rel=max(rel.values()),
        )
        entry["passes"] = (
            entry["min_mass_ratio"] >= FP8_GATE["min_mass_ratio"]
            and entry["loss_rel"] <= FP8_GATE["max_loss_rel"]
        )
        out[p] = entry
    out["gate"] = FP8_GATE
    return out


def evaluate(model, data, args, device) -> dict:
    autocast = _autocast(args, device)
    t0 = time.perf_counter()
    result = {}
    if not model.msa_layers():
        result["heldout"] = heldout_loss(model, data, args.eval_batches, autocast)
    else:
        by_precision = {}
        for p in PRECISIONS:
            set_mode(model, warmup=False, precision=p)
            try:
                by_precision[p] = heldout_loss(model, data, args.eval_batches, autocast)
            except Exception as e:  # a mode the backend in use does not run
                by_precision[p] = {"error": f"{type(e).__name__}: {e}"}
                print(f"held-out loss with selection_precision={p}: {e}", file=sys.stderr)
        result["heldout"] = by_precision["bf16"]
        result["heldout_by_precision"] = by_precision
        set_mode(model, warmup=True)
        result["heldout_dense_attention"] = heldout_loss(
            model, data, args.eval_batches, autocast
        )
        if args.recall_batches:
            result["selection"] = selection_metrics(model, data, args.recall_batches, autocast)
            result["fp8_gate"] = fp8_gate(by_precision, result["selection"])
        set_mode(model, warmup=False)
    result["eval_seconds"] = round(time.perf_counter() - t0, 1)
    return result


# ---------------------------------------------------------------------------------------------
# command line
# ---------------------------------------------------------------------------------------------
def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--attn", choices=("dense", "msa"), required=True)
    p.add_argument("--tiny", action="store_true", help="CPU configuration (seconds)")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--seq-len", type=int)
    p.add_argument("--batch", type=int, help="sequences per step")
    p.add_argument("--steps", type=int, help="total steps (the LR schedule's length)")
    p.add_argument("--lr", type=float)
    p.add_argument("--lr-warmup-steps", type=int)
    p.add_argument("--warmup-steps", type=int, help="MSA: dense warmup steps before sparse")
    p.add_argument("--eval-batches", type=int, help="held-out sequences of the final eval")
    p.add_argument("--eval-every", type=int, help="held-out loss every N steps (0: never)")
    p.add_argument("--eval-every-batches", type=int, help="held-out sequences for that loss")
    p.add_argument("--recall-batches", type=int, help="held-out sequences for recall/mass")
    p.add_argument("--stop-step", type=int, default=None,
                   help="end training before this step, on the schedule of --steps (to match "
                   "a run that --max-train-seconds stopped: pass its steps_done)")
    p.add_argument("--max-train-seconds", type=float, default=0.0,
                   help="stop training (then save and evaluate) once the run is this old")
    p.add_argument("--save", help="write model + optimizer + records here after training")
    p.add_argument("--load", help="resume from (or with --eval-only, evaluate) this checkpoint")
    p.add_argument("--eval-only", action="store_true")
    p.add_argument("--train-only", action="store_true", help="skip the final evaluation")
    p.add_argument("--device", help="cuda or cpu (default: cuda if available; --tiny: cpu)")
    p.add_argument("--dtype", choices=("bf16", "fp32"),
                   help="bf16 autocast over fp32 weights (GPU default) or fp32 (CPU default)")
    p.add_argument("--backend", choices=("auto", "cute", "triton", "torch"),
                   help="FLASH_MSA_BACKEND for this run (--tiny: torch)")
    p.add_argument("--dense-impl", choices=("auto", "fa4", "sdpa"), default="auto")
    p.add_argument("--threads", type=int,
                   help="torch CPU threads (--tiny: 1; small CPU ops lose more to a contended "
                   "thread pool than they gain)")
    p.add_argument("--sources", help="stdlib,site (default) or stdlib")
    p.add_argument("--corpus-mb", type=float, help="stop reading files past this many MiB")
    p.add_argument("--test-fraction", type=float, default=0.02)
    p.add_argument("--corpus-cache", help="keep the read corpus in this file for later runs")
    for f in dataclasses.fields(ModelConfig):
        p.add_argument("--" + f.name.replace("_", "-"), type=type(f.default), default=None)
    args = p.parse_args(argv)
    preset = {**DEFAULTS, **(TINY if args.tiny else {})}
    for name, value in preset.items():
        if getattr(args, name, None) is None:
            setattr(args, name, value)
    if args.device is None:
        args.device = "cpu" if args.tiny or not torch.cuda.is_available() else "cuda"
    if args.dtype is None:
        args.dtype = "bf16" if args.device.startswith("cuda") else "fp32"
    if args.backend is None and args.tiny:
        args.backend = "torch"
    if args.threads is None and args.tiny:
        args.threads = 1
    if args.eval_only and not args.load:
        p.error("--eval-only needs --load")
    if args.eval_only and args.train_only:
        p.error("--eval-only and --train-only exclude each other")
    if args.stop_step is not None and args.stop_step < 1:
        p.error("--stop-step must be >= 1")
    for name in ("seq_len", "batch", "steps", "eval_batches"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    for name in ("warmup_steps", "lr_warmup_steps", "eval_every",
                 "eval_every_batches", "recall_batches"):
        if getattr(args, name) < 0:
            p.error(f"--{name.replace('_', '-')} must be >= 0")
    if not 0 < args.test_fraction < 1:
        p.error(f"--test-fraction must be in (0, 1), got {args.test_fraction}")
    if not args.corpus_mb > 0 or not args.lr > 0:
        p.error("--corpus-mb and --lr must be > 0")
    return args


def model_config(args) -> ModelConfig:
    fields = {f.name: getattr(ModelConfig, f.name) for f in dataclasses.fields(ModelConfig)}
    tiny = TINY if args.tiny else {}
    for name in fields:
        value = getattr(args, name)
        fields[name] = value if value is not None else tiny.get(name, fields[name])
    return ModelConfig(**fields)


def dense_impl(args, device) -> str:
    if args.attn != "dense":
        return "msa"
    want = args.dense_impl
    if want == "auto":
        return "fa4" if device.type == "cuda" and _fa4() is not None else "sdpa"
    if want == "fa4" and (device.type != "cuda" or _fa4() is None):
        raise SystemExit("--dense-impl fa4 needs FlashAttention-4 (flash_attn.cute) on a GPU")
    return want


def environment(device) -> dict:
    env = dict(
        python=platform.python_version(),
        torch=torch.__version__,
        flash_msa=flash_msa.__version__,
        device=str(device),
        flash_msa_backend=os.environ.get("FLASH_MSA_BACKEND", "auto"),
    )
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
    return env


def phase_medians(records) -> dict:
    """Median step seconds per phase, the first step of each phase (compilation) left out."""
    out = {}
    for phase in ("dense", "warmup", "sparse"):
        times = [r["step_seconds"] for r in records if r["phase"] == phase]
        if times:
            out[phase] = statistics.median(times[1:] if len(times) > 1 else times)
    return out


def read_records(path: pathlib.Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def main(argv=None):
    t_start = time.perf_counter()
    args = parse_args(argv)
    if args.backend is not None:
        os.environ["FLASH_MSA_BACKEND"] = args.backend  # read by flash_msa at each call
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = model_config(args)
    impl = dense_impl(args, device)

    ckpt = None
    if args.load:
        ckpt = torch.load(args.load, map_location="cpu", weights_only=False)
        if ckpt["attn"] != args.attn or ckpt["model_config"] != dataclasses.asdict(cfg):
            raise SystemExit(
                f"--load {args.load} holds a {ckpt['attn']} model of {ckpt['model_config']}; "
                f"this run asks for {args.attn} with {dataclasses.asdict(cfg)}"
            )

    corpus = load_corpus(args)
    data = Batches(corpus, args.seq_len, args.batch, args.seed, device)
    print(f"corpus: {json.dumps(corpus['stats'])}", file=sys.stderr, flush=True)

    torch.manual_seed(args.seed)
    model = ByteLM(cfg, args.attn, impl if args.attn == "dense" else "sdpa")
    init_weights(model, args.seed)
    init_sum = checksum(model)
    if ckpt is not None:
        model.load_state_dict(ckpt["model"])
        state = dict(
            step=ckpt["step"],
            tokens_total=ckpt["tokens_total"],
            optimizer=ckpt["optimizer"],
            init_checksum=ckpt["init_checksum"],
            stopped_early=ckpt["stopped_early"],
        )
    else:
        state = dict(step=0, tokens_total=0, optimizer=None, init_checksum=init_sum)
    model.to(device)

    n_params = sum(p.numel() for p in model.parameters())
    n_indexer = sum(p.numel() for n, p in model.named_parameters() if is_indexer(n))
    if not args.eval_only and state["step"] < min(args.steps, args.stop_step or args.steps):
        state = train(model, data, args, device, out, state, t_start)
    train_seconds = time.perf_counter() - t_start
    if args.save and not args.eval_only:
        torch.save(
            dict(
                model=model.state_dict(),
                optimizer=state["optimizer"],
                step=state["step"],
                tokens_total=state["tokens_total"],
                init_checksum=state["init_checksum"],
                stopped_early=bool(state.get("stopped_early")),
                attn=args.attn,
                model_config=dataclasses.asdict(cfg),
            ),
            args.save,
        )

    records = read_records(out / "steps.jsonl")
    summary_path = out / "summary.json"
    summary = {}
    if args.eval_only and summary_path.exists():  # add the evaluation to the training's summary
        summary = json.loads(summary_path.read_text())
    summary.update(
        attn=args.attn,
        dense_impl=impl if args.attn == "dense" else None,
        environment=environment(device),
        parameters=dict(total=n_params, backbone=n_params - n_indexer, indexer=n_indexer),
        init_checksum=state["init_checksum"],
        steps_done=state["step"],
        tokens_trained=state["tokens_total"],
        corpus=corpus["stats"],
        step_seconds_median=phase_medians(records),
    )
    run_config = dict(
        model=dataclasses.asdict(cfg),
        **{k: v for k, v in vars(args).items() if k not in ModelConfig.__dataclass_fields__},
    )
    if args.eval_only:  # the training invocation's config and wall time stay
        summary["eval_config"] = run_config
    else:
        summary.update(config=run_config, train_wall_seconds=round(train_seconds, 1))
    if state.get("stopped_early"):
        summary["stopped_early"] = True
    if not args.train_only:
        summary.update(evaluate(model, data, args, device))
    summary["wall_seconds"] = round(time.perf_counter() - t_start, 1)
    summary_path.write_text(json.dumps(summary, indent=1) + "\n")
    held = summary.get("heldout", {}).get("loss")
    print(
        f"[{args.attn}] steps {state['step']}  tokens {state['tokens_total']}  heldout {held}  "
        f"({summary['wall_seconds']}s) -> {summary_path}",
        file=sys.stderr,
    )
    return summary


if __name__ == "__main__":
    main()
