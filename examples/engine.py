"""Using memcalc's engine from Python: no CLI, no torch.

    python examples/engine.py
"""

from memcalc import Parallel, Setup, canonical_model, estimate, fit_limits, gpu, parse_tricks, preset_model, toolbox

# The lesson's 8B model at seq 8192: the whole progression of tricks.
model = canonical_model(8_000_000_000)
result = estimate(model, Setup(seq_len=8192), gpu("h100-sxm"))
print(model.origin)
print(f"model state: {result.model_state.total_bytes:,} bytes")
for acts, memory in zip(result.activations, result.memory):
    print(f"{acts.tricks.label:16s} activations peak {acts.peak_bytes / 1e9:7.2f} GB, "
          f"total {memory.total_bytes / 1e9:7.1f} GB, fits: {memory.fits}")

# What would make Llama 3 70B fit, starting from bf16 + FlashAttention on 8 GPUs with ZeRO-1?
llama = preset_model("llama3-70b")
setup = Setup(seq_len=8192, parallel=Parallel(gpus=8, zero=1))
box = toolbox(llama, setup, gpu("h100-sxm"), parse_tricks("bf16,flash"))
for step in box.steps:
    print(f"{step.name:32s} -> {step.memory.total_bytes / 1e9:6.1f} GB, fits: {step.memory.fits}")

# The longest sequence one H200 can train the 8B model at, with checkpointing.
limits = fit_limits(model, Setup(seq_len=8192), gpu("h200"), parse_tricks("bf16,flash,ckpt"))
print(f"longest sequence on one H200: {limits.max_seq_len:,} tokens")
