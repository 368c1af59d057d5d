"""FlashInfer's paged decode and merge kernels as suite backends (CUDA only)."""
