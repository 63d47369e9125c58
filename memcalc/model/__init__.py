"""What is trained, and on what: the decoder's shape and parameter count (shape), named models (presets),
Hugging Face config.json files (hfconfig), trick sets (tricks), GPUs (gpus), number formats (formats),
and FLOPs per token (flops): arithmetic on the shape alone. jsonfile reads the JSON files a user names
(config.json, calibrations) with a bounded read, every failure one InputError line.

May import: memcalc.errors, memcalc.terms. The lowest layer: everything else builds on it.
"""
