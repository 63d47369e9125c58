"""Hugging Face Transformers' causal language models, as verify/hf.py trains them, op by op on memcalc.exact.sim.

  model          the families by model_type (families, arch_for), build and forward, the loss
                 (ForCausalLMLoss)
  family         what the families share: the model being replayed (HFModel) and one architecture (Family)
  attention      the causal mask and the attention interface the decoders share (masking_utils, sdpa, eager)
  dynamic_cache  Transformers' DynamicCache in a training step
  llama, gpt2, gpt_neox, gemma, olmo2, phi3
                 each family's decoder, as its modeling file writes it
  lora, qlora    PEFT's LoRA and frozen weights, modules_to_save's copies (verify/lora.py); bitsandbytes' 4-bit
                 base (verify/qlora.py)
  dora           PEFT's DoRA on a targeted projection: the weight's norm at every forward
  trl            what TRL's SFTTrainer adds: its k-bit preparation and casts, its loss metrics
  fused_head, chunked_nll
                 TRL's fused LM head (1.15-1.16) and loss_type chunked_nll (1.6-1.14): the loss without the logits
  dpo            TRL's DPOTrainer step (--rl dpo): chosen and rejected sequences, the reference's forward, the loss
  dpo_logits     TRL 1.3-1.13's DPOTrainer: its log-probabilities from the full logits
  grpo, rloo     TRL's GRPOTrainer and RLOOTrainer steps (--rl grpo, rloo): the buffered generation batch, the loss
  grpo_logits    TRL 1.9-1.13's GRPOTrainer: its log-probabilities from the logits (logits_to_keep, the temperature)
  ppo, ppo_rollout, ppo_models
                 TRL 1.3-1.12's PPOTrainer (--rl ppo): the PPO epochs (the value model beside the policy, the loop's
                 locals), each update's rollout before them (generate with output_scores, the scoring loop), and
                 its models (the critic, what is refused, how forward() and get_reward call a model)
  generate       the policy's own model.generate as those trainers call it without vLLM: the rollout phase
  scoring        their scoring passes between generating and training (the old and the reference's log-probs)
  liger          Liger's kernels as the Trainer applies them (use_liger_kernel): RMSNorm, RoPE, SwiGLU, the head
                 fused with the cross-entropy (verify/liger.py)

Adding a family: docs/architecture.md.

May import: memcalc.exact.builder (its layers), memcalc.exact.aten, memcalc.exact.sim, memcalc.exact.base,
and what they may.
"""
