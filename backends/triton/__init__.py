"""The project's own Triton decode kernels and their adapters.

Kernel modules (``*_kernel.py``) hold one ``@triton.jit`` kernel family and a host wrapper
that validates its inputs; ``backends.py`` adapts them to the suite. On a machine without a
CUDA GPU the kernels run under the Triton interpreter (``TRITON_INTERPRET=1``), which
``runtime.select_mode`` sets before any kernel module is imported.
"""
