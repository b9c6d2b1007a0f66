"""flash-msa: training kernels for MiniMax Sparse Attention (MSA).

Public API: :func:`msa_attention` (the fused op), :func:`select_blocks` and
:func:`sparse_attention` (its two halves), :func:`info` (which backend runs what, and why).
Layers are in :mod:`flash_msa.nn`, model conversions and trainer helpers in
:mod:`flash_msa.integrations`.

The distribution is ``flash-msa-kernels`` (``pip install flash-msa-kernels``); the import
package is ``flash_msa``.
"""

import importlib.metadata as _metadata
import warnings as _warnings

from .version import DISTRIBUTION, OTHER_DISTRIBUTION, __version__
_OWN_ENTRY_POINT = "flash_msa.cli:main"


class ConflictingDistributionWarning(UserWarning):
    """The other ``flash-msa`` distribution is installed next to this one."""


def _conflicting_distribution():
    """``(name, version)`` of an installed ``flash-msa`` distribution that is not this project,
    or None. An install of this project under that name (its console script points at
    ``flash_msa.cli:main``) is not a conflict."""
    try:
        dist = _metadata.distribution(OTHER_DISTRIBUTION)
    except _metadata.PackageNotFoundError:
        return None
    if any(ep.value == _OWN_ENTRY_POINT for ep in dist.entry_points):
        return None
    return dist.metadata["Name"], dist.version


def _warn_if_conflicting():
    found = _conflicting_distribution()
    if found is not None:
        _warnings.warn(
            f"the distribution {found[0]} {found[1]} (a different project) is installed in this "
            f"environment next to {DISTRIBUTION}; both install the import package flash_msa, "
            "so its files may belong to either. Run `pip uninstall flash-msa "
            f"{DISTRIBUTION}` and then `pip install {DISTRIBUTION}`.",
            ConflictingDistributionWarning,
            stacklevel=3,
        )


_warn_if_conflicting()  # once: a module body runs once per process

from .api import msa_attention, select_blocks, sparse_attention  # noqa: E402
from .backends import BackendError  # noqa: E402
from .diagnostics import info  # noqa: E402

__all__ = [
    "msa_attention",
    "select_blocks",
    "sparse_attention",
    "info",
    "BackendError",
    "ConflictingDistributionWarning",
    "__version__",
]
