"""What `memcalc serve` shows: one GPU's memory as vLLM splits it, the KV cache, what fits, and the time."""

from __future__ import annotations

from memcalc.model.sizes import MAX_SEQ
from memcalc.serve.answer import ServeAnswer
from memcalc.serve.profile import NATIVE_WARMUP_FROM, V2_COPY_UNTIL, triton_masks
from memcalc.serve.releases import counts_nccl
from memcalc.serve.sglang import RELEASE as SGLANG_RELEASE

from . import units as u
from .render import Section, sized
from .roofline import cal_origin

WEIGHT_LABELS = {"bf16": "bf16", "fp16": "fp16", "fp8": "fp8, per-tensor scales",
                 "fp8-block": "fp8, 128 x 128 block scales", "int8": "int8 GPTQ, group 128",
                 "int4-awq": "int4 AWQ, group 128", "int4-gptq": "int4 GPTQ, group 128"}  # fmt: skip


def layout_label(a: ServeAnswer) -> str:
    j = a.job
    parts = [f"tp {j.tp}", f"pp {j.pp}"] + ([f"dp {j.dp}, experts over {j.ep} GPUs"] if j.expert_parallel else [])
    return " x ".join(parts[:2]) + (f", {parts[2]}" if j.expert_parallel else "") + f" = {u.plural(j.gpus, 'GPU')}"


def serve_preamble(a: ServeAnswer, units: str) -> list[str]:
    j = a.job
    kv = "fp8" if j.kv_dtype == "fp8" else "16-bit"
    return [f"Model: {j.model.origin}",
            f"GPU: {j.gpu.name} ({j.gpu.key}), {u.size(j.gpu.memory_bytes, units)}; {layout_label(a)}",
            f"Serving: weights {WEIGHT_LABELS[j.weights]}, KV cache {kv}; vLLM gpu_memory_utilization "
            f"{j.utilization:g}, block {j.page_tokens}, max_num_batched_tokens {j.batched_tokens:,}, "
            f"max_num_seqs {j.seqs:,}; context {j.context:,} tokens a request",
            f"Budget as vLLM {j.vllm} computes it ({j.release.label}'s rule), on its {j.runner.upper()} model runner "
            f"(--vllm-version, --model-runner; {j.release.source})"]  # fmt: skip


def profile_label(a: ServeAnswer) -> str:
    p, j = a.activations, a.job
    by = {"flashinfer": "FlashInfer", "torch": "PyTorch", "greedy": "V2's greedy dummy"}[j.sampled_by]
    sampled = f", {p.requests:,} sampled by {by}" if p.sampler else ""
    return f"profile run: {p.tokens:,} tokens{sampled} ({p.at})"


def budget_section(a: ServeAnswer, units: str) -> Section:
    b, j = a.budget, a.job
    st = b.binding.stage
    where = "" if st.pp == 1 else \
        f" (pipeline stage {st.index} of {st.pp}, layers {st.start}-{st.end - 1}: the fewest blocks)"
    s = Section(f"Memory on one GPU{where}, as vLLM splits it", ["part", "bytes", "how"])
    total = "published" if j.gpu.cuda_total_mib else "derived"
    if j.gpu.memory_cap_bytes and j.gpu.memory_cap_bytes < (j.gpu.cuda_total_mib or j.gpu.memory_mib) * 1024 * 1024:
        total = "--gpu-memory"
    s.rows = [
        ["GPU memory", sized(b.total, units), f"torch.cuda.mem_get_info's total ({total})"],
        [f"x {b.utilization:g} utilization", sized(b.requested, units), "what vLLM may use"],
        ["- weights", sized(b.binding.weights, units),
         f"{u.params(a.weights.params)} parameters, {WEIGHT_LABELS[j.weights]}"],
        ["- activation peak", sized(b.binding.activations, units), profile_label(a)],
        ["- non-torch", sized(b.binding.non_torch, units), non_torch_label(a)],
        *([["- CUDA graphs", sized(b.binding.cudagraphs, units), "vLLM's estimate, as given (--cudagraph-memory)"]]
          if j.graph_estimate else []),
        *([["- runner's tensors", sized(b.binding.kept, units), f"what {j.runner.upper()}'s model runner keeps "
            "from its construction (total_consumed)"]] if j.counts_kept else []),
        ["= KV cache", sized(b.available, units),
         f"short by {u.size(b.binding.shortfall, units)}: the weights and activations exceed it"
         if b.binding.shortfall else f"{b.num_blocks:,} blocks of {b.block_size} tokens x {b.binding.group_size} layers"],
    ]  # fmt: skip
    if j.kv_cache_memory is not None:
        s.rows[-1][0] = "KV cache, given"
        s.rows.insert(-1, ["", "", "--kv-cache-memory: no profiling, utilization not applied"])
    s.notes = [budget_note(j), sampler_note(a) + "; not counted: the allocator's fragmentation"]
    return s


def budget_note(j) -> str:
    """determine_available_memory's formula for the job's release and runner (memcalc.serve.budget)."""
    parts = "weights + activation peak + non-torch memory" + \
        (" + the runner's kept tensors" if j.counts_kept else "")  # fmt: skip
    if j.graph_estimate:
        return (f"vllm/v1/worker/gpu_worker.py determine_available_memory: total x utilization - ({parts} + "
                "profile_cudagraph_memory's estimate, measured by vLLM, not modelled)")
    return (f"vllm/v1/worker/gpu_worker.py determine_available_memory: total x utilization - ({parts}); CUDA "
            "graphs are captured after the cache, in the 1 - utilization margin")


def sampler_note(a: ServeAnswer) -> str:
    """What the profile run's sampler holds at its peak (memcalc.serve.profile)."""
    j = a.job
    if j.sampled_by == "greedy":
        return "V2's profile run samples a greedy dummy batch: its logits" + \
            (" and their float32 copy" if j.minor < V2_COPY_UNTIL else "") + " over max_num_seqs x vocab"  # fmt: skip
    if j.profile_sampler == "flashinfer":
        return ("the sampler's peak is FlashInfer's top_k_top_p_sampling_from_logits over max_num_seqs x vocab "
                "(masked logits and their softmax, no sort)" +
                (", or PyTorch's path after it, whichever holds more" if j.minor >= NATIVE_WARMUP_FROM else ""))
    how = "top-k/top-p masking by a Triton kernel" if triton_masks(j, a.activations.requests) else "top-k/top-p sort"
    return f"the sampler's peak is PyTorch's {how} over max_num_seqs x vocab (--sampler flashinfer where vLLM " + \
        "takes FlashInfer's)"  # fmt: skip


def non_torch_label(a: ServeAnswer) -> str:
    """What the release counts outside torch's tensors (memcalc.serve.releases.non_torch_bytes)."""
    r, j = a.job.release, a.job
    parts = ["cuBLAS, kernels (published logs' median)"] + (["CUDA context"] if r.counts_context else []) + \
        (["NCCL's NVLS buffers"] if counts_nccl(r, j.tp * j.pp, j.gpu.intra) else [])  # fmt: skip
    return ", ".join(parts)


def kv_section(a: ServeAnswer, units: str) -> Section:
    j, kv = a.job, a.kv
    shape = j.model.shape
    s = Section("KV cache", ["layers", "keeps", "per token", "per request"])
    for k in kv.layers:
        keeps = f"last {k.window - 1:,} (window {k.window:,})" if k.window else "every token"
        s.rows.append([f"{k.count}", keeps, u.exact_bytes(k.bytes_per_token * k.count),
                       sized(k.bytes_per_token * k.count * k.kept(j.context), units)])  # fmt: skip
    if len(kv.layers) > 1:
        s.rows.append(["all", "", u.exact_bytes(kv.bytes_per_token), sized(kv.request_bytes, units)])
    if shape.is_mla:
        rule = (f"latent attention: (kv_lora_rank {shape.kv_lora_rank} + qk_rope_head_dim {shape.qk_rope_head_dim})"
                f" x {kv.element_bytes} B a layer, one head on every GPU")  # fmt: skip
    else:
        heads = max(1, shape.n_kv_heads // j.tp)
        rule = f"2 (k, v) x {heads} KV heads x head_dim {shape.head_dim} x {kv.element_bytes} B a layer"
    s.notes = [f"per token: {rule}",
               "per request: what Transformers' DynamicCache holds at the context; vLLM's paged cache reserves "
               "whole blocks, and for a sliding layer its window plus max_num_batched_tokens and a block"]  # fmt: skip
    return s


def context_label(n: int) -> str:
    return "no limit (every layer slides)" if n >= MAX_SEQ else f"{n:,} tokens"


def fit_section(a: ServeAnswer) -> Section:
    b, j = a.budget, a.job
    s = Section(f"What fits at {j.context:,} tokens a request", ["", "value"])
    blocks = b.request_blocks(j.context, j.batched_tokens)
    s.rows = [["KV cache size", f"{b.cache_tokens:,} tokens"],
              ["a request's blocks", f"{blocks:,} of {b.num_blocks:,}"],
              ["maximum concurrency", f"{a.max_concurrency:.2f}x"],
              ["concurrent requests", f"{a.requests:,}" + (" (max_num_seqs)" if a.requests == j.seqs else "")],
              ["longest context, one request", context_label(a.longest_context)]]  # fmt: skip
    s.notes = ["as vLLM logs them: \"GPU KV cache size\", \"Maximum concurrency for N tokens per request\" "
               "(vllm/v1/core/kv_cache_utils.py); the longest context is estimate_max_model_len's search, "
               "not stopped at max_model_len as vLLM's is"]
    return s


def time_section(a: ServeAnswer) -> Section:
    t, j = a.time, a.job
    s = Section(f"Time on the roofline, batch {t.batch:,}", ["", "value", "bound by"])
    s.rows = [["time to first token", u.seconds(t.ttft_seconds),
               f"{t.prefill.linear.bound} (prefill of {j.context:,})"],
              ["time per output token", u.seconds(t.tpot_seconds), f"{t.decode.linear.bound} (decode)"],
              ["decode tokens/s", u.rate(t.tokens_per_second), f"{t.batch:,} requests"]]  # fmt: skip
    cal = j.calibration
    s.notes = [f"{cal_origin(cal)}: matmul {cal.matmul:g}, flash {cal.flash:g}, bandwidth {cal.bandwidth:g} "
               "(training's); decode reads every weight and each request's cache at the context",
               "not modelled: scheduling, sampling, kernel launches (CUDA graphs), TP all-reduces, chunked prefill"]
    return s


def detail_sections(a: ServeAnswer, units: str) -> list[Section]:
    w, p = a.weights, a.activations
    weights = Section("Weights on one GPU", ["part", "bytes"])
    weights.rows = [[f"{w.layers} blocks' linear weights ({WEIGHT_LABELS[w.fmt]})", sized(w.matrices_bytes, units)],
                    ["embedding, head, norms, biases, routers (16-bit)", sized(w.sixteen_bit_bytes, units)]]
    peak = Section("Profile run's activations, by part", ["part", "bytes"])
    peak.rows = [[name, sized(getattr(p, name), units)] for name in ("attention", "mlp", "sampler")]
    roof = Section("Roofline parts", ["step", "part", "FLOPs", "bytes", "compute", "memory"])
    for name, step in (("prefill", a.time.prefill), ("decode", a.time.decode)):
        for part in ("linear", "attention"):
            r = getattr(step, part)
            roof.rows.append([name, part, u.count(r.flops), u.size(r.bytes, units), u.seconds(r.compute_seconds),
                              u.seconds(r.memory_seconds)])  # fmt: skip
    return [weights, peak, roof]


def changes_section(a: ServeAnswer) -> Section:
    s = Section("What to change", ["change", "requests at the context", "longest context"])
    s.rows = [[c.change, f"{c.requests:,}", context_label(c.longest_context)] for c in a.changes]
    return s


def sglang_section(a: ServeAnswer, units: str) -> Section:
    """SGLang's pool on the same GPU (memcalc.serve.sglang), beside vLLM's budget."""
    p, j = a.sglang, a.job
    s = Section(f"SGLang {SGLANG_RELEASE} on the same GPU, beside vLLM", ["part", "bytes", "how"])
    why = "--mem-fraction-static" if p.given else (
        f"its heuristic: 1 - {p.reserved_mib:,.0f} MiB reserved of {j.gpu.memory_mib:,} (chunked prefill "
        f"{p.chunked_prefill:,}, decode graphs to {p.decode_graph_batch})")  # fmt: skip
    s.rows = [["free before the weights", sized(p.pre_load, units), "mem_get_info's total less the CUDA context"
               + (" and NCCL's buffers" if p.nccl else "")],
              [f"x {p.mem_fraction_static:g} mem_fraction_static", sized(p.available + p.weights, units), why],
              ["- weights", sized(p.weights, units), WEIGHT_LABELS[j.weights]],
              ["= KV cache", sized(p.available, units), f"{p.tokens:,} tokens of {p.cell:,} B"],
              ["max_running_requests", f"{p.max_running_requests:,}", f"at context {j.context:,}"]]  # fmt: skip
    s.notes = ["sglang mem_cache/kv_cache_configurator.py _profile_available_bytes: free memory after the weights "
               "less pre_model_load_memory x (1 - mem_fraction_static); its request table, attention workspaces and "
               "CUDA graphs come after, in what is left"]
    return s


def serve_sections(a: ServeAnswer, units: str, detail: bool = False) -> list[Section]:
    out = [budget_section(a, units), kv_section(a, units), fit_section(a), time_section(a)]
    if a.sglang:
        out.insert(3, sglang_section(a, units))
    if a.changes:
        out.append(changes_section(a))
    return out + (detail_sections(a, units) if detail else [])


def serve_verdict(a: ServeAnswer) -> str:
    j, b = a.job, a.budget
    if b.binding.shortfall or not b.available:
        taken = b.binding.weights + b.binding.activations
        return (f"Does not fit: the weights and the activation peak take {u.size(taken)} of the "
                f"{u.size(b.requested)} vLLM may use, and nothing is left for the KV cache.")
    if a.requests < 1:
        return (f"Does not fit: not one request of {j.context:,} tokens; the longest the KV cache holds is "
                f"{context_label(a.longest_context)}.")  # fmt: skip
    util = "" if j.gpu_memory_utilization is None else f" at utilization {j.utilization:g}"
    short = f" ({j.batch:,} asked)" if j.batch and not a.fits else ""
    return (f"{a.requests:,} concurrent requests of {j.context:,} tokens fit{util}{short}; decoding "
            f"{a.time.batch:,} together: {u.rate(a.time.tokens_per_second)} tokens/s, "
            f"{u.seconds(a.time.tpot_seconds)} per token.")
