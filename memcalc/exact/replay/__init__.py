"""The step replayed as verify runs it: one GPU, a ZeRO rank, an FSDP2 rank, and torch.compile's kernels.

  meta         verify/meta.py: the model built, a warm-up step, the measured one with every phase's peak
               (simulate), and the kernels of one step (trace)
  zero         one data-parallel rank of memcalc's generic ZeRO
  fsdp2        one rank of FSDP2 as torchtitan runs it (fsdp2_units: its units, groups and their hooks)
  fsdp2_lora   one rank of FSDP2 over PEFT's LoRA model as accelerate shards it, on zero's unit boundaries
  inductor     torch.compile's fused kernels, from the eager step's
  ppo          PPOTrainer's rollout (--rl ppo) beside what the previous update left (memcalc.exact.hf.ppo_rollout)

May import: memcalc.exact.train, memcalc.exact.hf, memcalc.exact.builder, memcalc.exact.aten,
memcalc.exact.sim, memcalc.exact.base, and what they may.
"""
