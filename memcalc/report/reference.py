"""The reference tables: presets, GPUs, number formats (with the three demonstrations)."""

from __future__ import annotations

from memcalc.model import formats as fm
from memcalc.model.gpu_table import DEFAULT_GPU, GPUS
from memcalc.model.presets import CANONICAL, PRESETS, canonical_shape
from memcalc.model.shape import param_counts

from . import units as u
from .render import Section


def preset_rows() -> list[dict]:
    rows = []
    for key, s in PRESETS.items():
        counts = param_counts(s)
        rows.append({
            "name": key, "family": s.family, "layers": s.n_layers, "hidden": s.hidden, "heads": s.n_heads,
            "kv_heads": s.n_kv_heads, "head_dim": s.head_dim, "ffn": s.ffn, "vocab": s.vocab,
            "tied_embeddings": s.tied_embeddings, "params": counts.total,
            "non_embedding_params": counts.total - counts.embedding - counts.lm_head, "canonical": key in CANONICAL,
            "experts": s.n_experts, "experts_per_token": s.experts_per_token, "shared_experts": s.n_shared_experts,
            "expert_ffn": s.routed_ffn if s.is_moe else 0, "moe_layers": counts.moe_layers,
            "kv_lora_rank": s.kv_lora_rank, "main_params": counts.main, "mtp_params": counts.mtp,
            "active_params": counts.active,
        })  # fmt: skip
    return rows


def moe_section(rows: list[dict]) -> Section:
    """The mixture-of-experts presets: experts, which layers, latent attention, total and active counts."""
    s = Section("Mixture-of-experts presets: total and active parameters per token",
                ["name", "experts", "expert ffn", "MoE layers", "attention", "total", "active"], align="lrrrlrr")  # fmt: skip
    for r in rows:
        if not r["experts"]:
            continue
        shared = f" + {r['shared_experts']} shared" if r["shared_experts"] else ""
        attention = f"MLA, kv rank {r['kv_lora_rank']}" if r["kv_lora_rank"] else "GQA"
        s.rows.append([r["name"], f"{r['experts_per_token']} of {r['experts']}{shared}", str(r["expert_ffn"]),
                       f"{r['moe_layers']} of {r['layers']}", attention, u.params(r["main_params"]),
                       u.params(r["active_params"])])  # fmt: skip
    s.notes = ["total: the main model; active: what one token goes through (embedding included, the routed "
               "experts it is not sent to left out); docs/moe.md holds them against the published figures"]  # fmt: skip
    mtp = [r for r in rows if r["mtp_params"]]
    s.notes += [f"{r['name']}: + {u.params(r['mtp_params'])} in its multi-token prediction module, trained with "
                "the model (params above includes it)" for r in mtp]  # fmt: skip
    return s


def preset_sections() -> list[Section]:
    s = Section("Model presets (--model NAME); * marks the canonical shapes behind --params N",
                ["name", "family", "layers", "hidden", "heads", "kv", "head_dim", "ffn", "vocab", "params"], align="llrrrrrrrr")  # fmt: skip
    for r in preset_rows():
        s.rows.append([r["name"] + (" *" if r["canonical"] else ""), r["family"], str(r["layers"]), str(r["hidden"]),
                       str(r["heads"]), str(r["kv_heads"]), str(r["head_dim"]), str(r["ffn"]), f"{r['vocab']:,}",
                       f"{r['params']:,}"])  # fmt: skip
    example = canonical_shape(8_000_000_000)
    s.notes = [
        "--params N uses the canonical shape nearest to N (in log scale), if within 2x of its own count, and "
        "charges model state for exactly N",
        f"e.g. 8e9 -> {example.name}: {example.n_layers} layers, hidden {example.hidden}, {example.n_heads} heads",
    ]
    rows = preset_rows()
    return [s, moe_section(rows)] if any(r["experts"] for r in rows) else [s]


def gpu_rows() -> list:
    return list(GPUS.values())


def gpu_sections() -> list[Section]:
    from memcalc.parallel.links import LINKS

    s = Section(
        "GPUs (--gpu KEY, or --gpu FILE.json): dense peak TFLOP/s, memory, bandwidth",
        ["key", "name", "bf16", "fp16", "tf32", "fp32", "fp8", "memory", "mem_get_info", "bandwidth"],
        align="llrrrrrrrr",
    )
    for g in GPUS.values():
        s.rows.append([g.key + (" (default)" if g.key == DEFAULT_GPU else ""), g.name, rate(g.bf16_tflops),
                       rate(g.fp16_tflops), rate(g.tf32_tflops), rate(g.fp32_tflops), rate(g.fp8_tflops),
                       f"{g.memory_mib:,} MiB", f"{g.cuda_total_bytes >> 20:,} MiB" + ("" if g.cuda_total_mib else "*"),
                       f"{g.bandwidth_gbps / 1000:g} TB/s"])  # fmt: skip
    s.notes = [
        "rates: vendor datasheets, dense (sparse figures are 2x); bf16/fp16 with fp32 accumulate, as PyTorch's "
        "matmuls run (GeForce: half the fp16-accumulate rate); fp32 is the non-tensor-core rate PyTorch uses unless "
        "TF32 is enabled; - : no such tensor cores (bf16 and fp8 jobs are refused there)",
        "memory: the driver's total; each fit verdict keeps a headroom back (CUDA context, cuBLAS workspaces, NCCL "
        "buffers, the allocator's share): --headroom, --gpu-memory, docs/gpus.md",
        "mem_get_info: torch.cuda.mem_get_info's total, which vLLM budgets from (memcalc serve), as vLLM's logs or "
        "PyTorch's out-of-memory message print it (memcalc/model/gpu_table.py CUDA_TOTAL_SOURCES); *: none "
        "published, the driver's total less their median reserve",
    ]
    fabrics: dict[str, list[str]] = {}
    for g in GPUS.values():
        fabrics.setdefault(g.intra, []).append(g.key)
    s.notes += [f"in a node, {LINKS[link].name} ({LINKS[link].gb_per_s:g} GB/s per direction): {', '.join(keys)}"
                for link, keys in fabrics.items()]  # fmt: skip
    sources: dict[str, list[str]] = {}
    for g in GPUS.values():
        sources.setdefault(g.source, []).append(g.key)
    s.notes += [f"{', '.join(keys)}: {url}" for url, keys in sources.items()]
    return [s]


def rate(tflops: float) -> str:
    return f"{tflops:g}" if tflops else "-"


def format_rows() -> dict:
    return {
        "formats": list(fm.FORMATS.values()),
        "rounding": fm.rounding_demo(),
        "underflow": fm.underflow_demo(),
        "accumulation": fm.accumulation_demo(),
    }


def format_sections() -> list[Section]:
    table = Section(
        "Floating-point formats, computed from their bit layouts",
        ["format", "sign/exp/mantissa", "max", "spacing next to 1", "smallest normal", "smallest subnormal", "digits"],
    )
    for f in fm.FORMATS.values():
        table.rows.append([f.name, f"1/{f.exp_bits}/{f.man_bits}", f"{f.max_value:.8g}", f"{f.eps:.8g}",
                           f"{f.min_normal:.4g}", f"{f.min_subnormal:.4g}", f"{f.decimal_digits:.1f}"])  # fmt: skip
    r, w, a = fm.rounding_demo(), fm.underflow_demo(), fm.accumulation_demo()
    demos = Section("Three demonstrations, computed by exact rounding", ["demonstration", "bf16 / fp16", "fp32"], align="lll")
    demos.rows = [
        [f"{r.one:g} + {r.small:g}", f"{r.bf16_sum!r} (bf16: spacing {r.bf16_eps:g})",
         f"{r.fp32_sum!r} (spacing {r.fp32_eps:.3g})"],
        [f"gradient {w.grad:g} in fp16", f"{w.fp16_grad:g} (smallest subnormal {w.fp16_min_subnormal:.3g})", ""],
        [f"  x loss scale {w.scale:g}", f"{w.fp16_scaled:.5g} in fp16",
         f"{w.fp32_unscaled:.5g} unscaled (error {u.percent(w.rel_error, 3)})"],
        [f"dot product of {a.n:,} terms (exact {a.exact:.7g})", f"{a.bf16_sum:.7g} bf16 accumulation "
         f"(error {u.percent(a.bf16_rel_error)})", f"{a.fp32_sum:.7g} (error {a.fp32_rel_error:.2g})"],
    ]  # fmt: skip
    demos.notes = [
        "bf16 keeps fp32's range but 8 bits of precision: small updates vanish next to large values",
        "fp16 has precision but little range: loss scaling lifts small gradients into it",
        "tensor cores multiply in bf16 but accumulate in fp32 for exactly this reason",
    ]
    return [table, demos]


def preset_csv() -> tuple[list[str], list[list[object]]]:
    rows = preset_rows()
    return list(rows[0]), [list(r.values()) for r in rows]


def gpu_csv() -> tuple[list[str], list[list[object]]]:
    headers = ["key", "name", "bf16_tflops", "fp16_tflops", "tf32_tflops", "fp32_tflops", "fp8_tflops", "memory_bytes",
               "bandwidth_gbps", "arch", "intra", "inter", "host", "source"]  # fmt: skip
    return headers, [[getattr(g, h) for h in headers] for g in GPUS.values()]


def format_csv() -> tuple[list[str], list[list[object]]]:
    headers = ["name", "bits", "exp_bits", "man_bits", "max_value", "eps", "min_normal", "min_subnormal"]
    return headers, [[repr(v) if isinstance(v, float) else v for v in (getattr(f, h) for h in headers)]
                     for f in fm.FORMATS.values()]  # fmt: skip


# command name -> (its tables, the result objects its JSON carries, its CSV table of raw values)
REFERENCE = {
    "presets": (preset_sections, preset_rows, preset_csv),
    "gpus": (gpu_sections, gpu_rows, gpu_csv),
    "formats": (format_sections, format_rows, format_csv),
}
