"""Hand-written attention kernels for a decode step's few queries over a KV cache.

``flash`` (CUDA, Pallas Triton) and ``flash_tpu`` (TPU, Pallas Mosaic) each return the softmax
partials of the queries over one layer's cache; ``partials`` merges them with the block's own
keys and picks the kernel branch per platform; ``plugins`` says which accelerator plugins this
jaxlib has. The package is a leaf below ``nn``: it imports no model code.
"""
