"""Apache TVM's own decode and merge kernels under the spec.

The kernels are imported from the installed ``apache-tvm``
(``tvm.relax.frontend.nn.llm._decode_kernels``), never copied: ``layout`` converts the
canonical problem to TVM's paged KV cache layout, ``kernels`` compiles (or loads ahead-of-time
builds of) the kernels, ``backends`` adapts them to the suite.
"""
