"""A conformance suite for paged decode attention kernels.

The spec (``spec.toml``) expands into cases; ``problem`` materialises them adversarially;
``checks`` judge a backend against the float64 oracle in ``conformance.references``;
``runner``, ``report``, ``cli`` and ``pytest_plugin`` run and present it.

Everything installs under this one name: the repository's top-level ``backends/``,
``references/`` and ``expectations/`` become ``conformance.backends``,
``conformance.references`` and ``conformance.expectations`` (pyproject.toml maps them), so a
project's own ``backends`` package is never shadowed. Run from a checkout, where those folders
sit beside this one, the package looks for its subpackages there too.
"""

from pathlib import Path as _Path

__version__ = "0.1.0"

_checkout = _Path(__file__).resolve().parent.parent
if (not (_Path(__file__).parent / "backends").is_dir()
        and (_checkout / "backends" / "registry.py").is_file()):
    __path__.append(str(_checkout))
