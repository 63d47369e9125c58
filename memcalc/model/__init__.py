"""What is trained, and on what: the decoder's shape and parameter count (shape), named models (presets),
Hugging Face config.json files (hfconfig), trick sets (tricks), GPUs (gpus), number formats (formats),
and FLOPs per token (flops): arithmetic on the shape alone.

May import: memcalc.errors, memcalc.terms. The lowest layer: everything else builds on it.
"""
