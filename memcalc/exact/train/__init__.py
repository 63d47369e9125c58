"""The training recipes, as verify/recipes.py and verify/autocast.py run them: what the optimizer step keeps,
converts and frees.

  recipes     verify/recipes.py: the reference recipe (an fp32 master, AdamW written out) and torch.optim's
              (TorchRecipe); what the simulator refuses to train (check_simulated)
  optimizers  torch.optim's AdamW and SGD, bitsandbytes' AdamW8bit, each implementation's temporaries
  amp         verify/autocast.py: torch.autocast over fp32 weights, GradScaler for fp16

May import: memcalc.exact.hf, memcalc.exact.builder, memcalc.exact.aten, memcalc.exact.sim, memcalc.exact.base,
and what they may.
"""
