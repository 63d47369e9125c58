"""torchtune's recipes, as verify/torchtune.py trains them (pytorch/torchtune @ v0.6.1), op by op on memcalc.exact.sim.

  modules  torchtune/modules: RMSNorm (F.rms_norm over x.float()), RotaryPositionalEmbeddings (and
           Llama3ScaledRoPE, the same forward), MultiHeadAttention (k and v expanded to every head, SDPA),
           FeedForward, TransformerSelfAttentionLayer; LoRALinear (adapters in the model's dtype)
  nf4      torchao's NF4Tensor (QLoRA's base: 4-bit data, double-quantised block scalers) and linear_nf4
  model    TransformerDecoder: its parameters, build, forward and unembed (chunked output or the head in
           fp32), and the recipes' _loss_step with CEWithChunkedOutputLoss or CrossEntropyLoss

May import: memcalc.exact.hf (its attention's SDPA path), memcalc.exact.builder (its layers),
memcalc.exact.aten, memcalc.exact.sim, memcalc.exact.base, and what they may.
"""
