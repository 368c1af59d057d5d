"""PyTorch's own attention kernels as suite backends: ``flex_attention`` and the LSE-returning
ops behind ``scaled_dot_product_attention``. Torch is imported only when one of them is used."""
