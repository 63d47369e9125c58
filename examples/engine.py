"""Using memcalc's engine from Python: no CLI, no torch.

    python examples/engine.py
"""

from memcalc import Job, Layout, Setup, answer, canonical_model, fit_limits, gpu, parse_tricks, preset_model, toolbox

# The lesson's 8B model at seq 8192: the whole progression of tricks, as `memcalc estimate` answers it.
model = canonical_model(8_000_000_000)
result = answer(Job(model, Setup(seq_len=8192), gpu("h100-sxm")))
print(model.origin)
print(f"textbook model state: {result.textbook.model_state.total_bytes:,} bytes")
for verdict, book, layout in zip(result.verdicts, result.textbook.memory, result.layouts):
    print(f"{verdict.tricks.label:16s} peak {verdict.total_bytes / 1e9:6.1f} GB (textbook {book.total_bytes / 1e9:6.1f}), "
          f"fits: {verdict.fits!s:5s}, step {layout.time.step_seconds:5.2f} s")

# What would make Llama 3 70B fit, starting from bf16 + FlashAttention on 8 GPUs with ZeRO-1?
llama = preset_model("llama3-70b")
box = toolbox(llama, Setup(seq_len=8192), gpu("h100-sxm"), parse_tricks("bf16,flash"), Layout(dp=8, zero=1))
for step in box.steps:
    after = f"{step.verdict.total_bytes / 1e9:6.1f} GB, fits: {step.verdict.fits}" if step.kept else "not applied"
    print(f"{step.name:45s} -> {after}")
print(f"{box.outcome}" + (f": {box.steps[box.fits_at].name}" if box.fits_at is not None else ""))

# The longest sequence one H200 can train the 8B model at, with checkpointing.
limits = fit_limits(model, Setup(seq_len=8192), gpu("h200"), parse_tricks("bf16,flash,ckpt"))
print(f"longest sequence on one H200: {limits.max_seq_len:,} tokens")
