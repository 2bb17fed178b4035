"""What a run needs to know and do about its device, kept out of the model and the parallel passes.

- `kernels`: which optimizer kernels to use (fused AdamW on CUDA, `torch._foreach_*` elsewhere) and pinned host
  buffers for asynchronous host/device copies.
- `attention`: which `scaled_dot_product_attention` backend (flash, memory-efficient, cuDNN or math) really runs,
  recorded once per run (Dao et al., FlashAttention, arXiv 2205.14135; Rabe & Staats, arXiv 2112.05682).
- `timing`: step times without a host synchronisation inside the step (CUDA events on GPUs).
- `cuda_memory`: the CUDA caching allocator's peaks beside our byte accounting and the planner's prediction.
- `sync`: counting host synchronisations (reads of tensor values) in a region, for tests and benchmarks.

Everything here runs on CPU too: CUDA-only paths are reached through a `cuda` argument that tests replace.
"""
