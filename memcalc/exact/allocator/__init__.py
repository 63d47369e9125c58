"""PyTorch's CUDA caching allocator replayed over a run's allocations and frees: the reserved bytes a GPU
runs out of, beside the allocated bytes the tensors hold.

  caching      the allocator's pools, blocks and segments, as c10/cuda/CUDACachingAllocator.cpp has them
  expandable   PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True: one segment per stream that grows by pages
  replay       a run's events through it: its peak reserved and allocated, the idle reserve, out of memory
  snapshot     its trace and its segments as torch.cuda.memory._snapshot() reports them

May import: memcalc.records.
"""
