"""What is trained, and on what: the decoder's shape (shape; its mixture-of-experts and latent-attention
fields' rules and which layers are MoE: moe_mla), its parameter count (params), the limits on sizes and the
parsing of counts like '70B' and '8k' (sizes), named models (presets), Hugging Face config.json files
(hfconfig), the MoE routing assumption (moe), trick sets (tricks), training stacks (stacks) and RL on them
(rl), how a job's GPUs are laid out (layout), GPUs (gpus; the table of cards: gpu_table; a card in a JSON file:
gpu_file; what PyTorch holds on one beyond the tensors: headroom), number formats (formats), and FLOPs per token
(flops): arithmetic on the shape alone. jsonfile reads the JSON files a user names (config.json,
calibrations) with a bounded read, every failure one InputError line.

May import: memcalc.errors, memcalc.terms. The lowest layer: everything else builds on it.
"""
