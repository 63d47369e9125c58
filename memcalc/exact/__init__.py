"""Bytes and kernels, op by op: a byte-level replay of verify/'s models and training steps, without torch.

Its rooms, lowest first; each imports only those before it (tests/test_layering.py holds it):
  base      the records every room shares: StepConfig and Phases, Kernel, the disk cache
  allocator PyTorch's CUDA caching allocator: segments, pools, splits, expandable segments, in bytes
  sim       PyTorch's eager memory in bytes: tensors and their storages, autograd's graph and backward
            engine, activation checkpointing, what each allocation is
  aten      the aten ops: what each allocates, saves and launches; torch.autocast's cast policy; the fp8
            linears (torchao's Float8Linear, Transformer Engine's te.Linear)
  builder   memcalc's reference model, as verify/builder.py builds it
  hf        Transformers' model classes as verify/hf.py trains them; PEFT's LoRA and bitsandbytes' QLoRA
  torchtune torchtune's TransformerDecoder as verify/torchtune.py trains it; torchao's NF4 and bf16 adapters
  train     the training recipes: the reference loop, torch.optim and bitsandbytes' optimizers, torch.amp
  replay    the step as verify runs it: one GPU (meta), a ZeRO rank, an FSDP2 rank; torch.compile's kernels
and on top, the entry points the rest of memcalc calls:
  kernels   one block's kernels traced once: the roofline's inventory and the FLOPs a step executes
  step      the step's terms, phases and FLOPs (exact_step, step_phases), grown to full depth (growth)
  timeline  the step event by event, at full depth, for --timeline
  reserved  what the caching allocator reserves over the step, on a card of a given capacity

May import: memcalc.model, memcalc.errors, memcalc.records, memcalc.terms.
"""
