"""Bytes and kernels, op by op: a byte-level replay of verify/'s model and training step.

  aten         what each aten op allocates and saves, by family: aten_operands, aten_views,
               aten_arithmetic, aten_activations, aten_matmul, aten_fused, aten_indexing; the fp8 linears:
               aten_float8 (torchao's Float8Linear), aten_te (Transformer Engine's te.Linear)
  sim          runs them under autograd's lifetimes (tensors: bytes, storages, tensors; backward: the
               engine; checkpoint: non-reentrant and selective checkpointing)
  builder      verify/builder.py's model line by line: its parameters and forward (builder_layers: the
               norms, RoPE, attention and MLP; builder_moe: a mixture of experts and latent attention)
  hf           Transformers' model classes as verify/hf.py trains them (hf_llama, hf_gpt2: the decoders;
               hf_attention: the causal mask and the attention interface they share)
  recipes      verify/recipes.py line by line
  optimizers   torch.optim's and bitsandbytes' optimizer steps
  autocast     torch.autocast's lists and cast cache
  amp          the stock loop's GradScaler and step, as verify/autocast.py
  config       what a step is
  mirror       runs the measured step as verify/meta.py does
  zero         one data-parallel rank's step under ZeRO
  fsdp2        one rank of FSDP2 as torchtitan runs it (fsdp2_units: its units, groups and their hooks)
  step         turns it into terms, phases and FLOPs (growth: the full depth grown from two short steps;
               cache: kept on disk)
  kernels      traces one block's kernels once: the roofline's inventory and the FLOPs a step executes
               (hardware FLOPs)
  timeline     the step event by event, at full depth, for --timeline (events: what each allocation is)

May import: memcalc.model, memcalc.errors, memcalc.terms.
"""
