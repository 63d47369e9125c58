"""The simulator core: PyTorch's eager memory behaviour in bytes, no values, no torch.

  tensors     LiveBytes (the live bytes and their peaks, as verify/track.py's LiveBytes measures them),
              Storage, Tensor and the Region of equal copies
  graph       autograd's Node and the Graph that records them in forward and runs backward; the kernels
  backward    the backward engine's order and its gradient buffers
  checkpoint  non-reentrant and selective activation checkpointing (torch.utils.checkpoint)
  events      what each allocation is, for the timeline

May import: memcalc.exact.base, and what it may.
"""
