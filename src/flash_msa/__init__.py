"""flash-msa: training kernels for MiniMax Sparse Attention (MSA).

Public API: :func:`msa_attention` (the fused op), :func:`select_blocks` and
:func:`sparse_attention` (its two halves), :func:`info` (which backend runs what, and why).
"""

__version__ = "0.1.0.dev0"  # the one place it is written (pyproject.toml reads it)

from .api import msa_attention, select_blocks, sparse_attention
from .backends import BackendError
from .diagnostics import info

__all__ = ["msa_attention", "select_blocks", "sparse_attention", "info", "BackendError"]
