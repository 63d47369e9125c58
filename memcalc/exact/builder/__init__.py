"""memcalc's reference model, as verify/builder.py builds it, op by op on memcalc.exact.sim.

  model   verify/builder.py: the parameters as nn.Module registers them, the blocks, checkpointing, the
          logits and the loss (Transformer, build, forward)
  layers  verify/builder_layers.py: the norms, linear, dropout, RoPE, attention and the MLP
  moe     verify/builder_moe.py: a mixture of experts and latent attention

May import: memcalc.exact.aten, memcalc.exact.sim, memcalc.exact.base, and what they may.
"""
