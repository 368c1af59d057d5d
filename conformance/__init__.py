"""A conformance suite for paged decode attention kernels.

The spec (``spec.toml``) expands into cases; ``problem`` materialises them adversarially;
``checks`` judge a backend against the float64 oracle in ``references``; ``runner``,
``report``, ``cli`` and ``pytest_plugin`` run and present it.
"""

__version__ = "0.1.0"
