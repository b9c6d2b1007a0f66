"""The package's version and distribution names, written once (pyproject.toml reads
``__version__``; the package ``__init__``, the CLI, ``info()`` and the bench import them)."""

__version__ = "0.1.0.dev0"

DISTRIBUTION = "flash-msa-kernels"
# another project on PyPI, distributed as "flash-msa", installs an import package of the same
# name: whichever was installed last owns flash_msa/, and files of both may be mixed
OTHER_DISTRIBUTION = "flash-msa"
