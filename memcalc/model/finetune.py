"""Fine-tuning: which weights train. Full training (FULL) trains every weight; LoRA (Hu et al. 2021) freezes the
base model and trains two low-rank matrices beside each targeted linear layer, as PEFT builds them
(peft/tuners/lora/layer.py LoraLayer.update_layer: lora_A (r, in), lora_B (out, r), B initialised to zeros).

The record travels with the stack (memcalc.model.stacks.Stack.finetune), so the textbook's model state, the
exact replay, its kernels (the time) and verify all read the same one.
"""

from __future__ import annotations

from memcalc.errors import InputError
from memcalc.records import record

from .bnb import MIN_PAGED_SIZE
from .params import layer_params, n_params
from .shape import ModelShape

# The linear projections of a Llama-style block, as Transformers names them (modeling_llama.py LlamaAttention,
# LlamaMLP); PEFT's target_modules="all-linear" takes every nn.Linear but the output layer
# (peft/tuners/tuners_utils.py _maybe_include_all_linear_layers: lm_head excluded), which is these.
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
HEAD = "lm_head"  # LoRA on the output layer: PEFT's target_modules=[..., "lm_head"], torchtune's apply_lora_to_output
# Blocks whose projections are not Llama's seven, in their modules' order: all-linear wraps these (Phi-3 fuses q, k, v
# and gate, up, and registers o_proj before qkv_proj; GPT-NeoX and GPT-2 name theirs their own way)
FUSED = {"phi3": ("o_proj", "qkv_proj", "gate_up_proj", "down_proj"),
         "gpt_neox": ("query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"),  # GPTNeoXAttention, GPTNeoXMLP
         "gpt2": ("c_attn", "c_proj", "c_fc")}  # GPT2Attention's and GPT2MLP's Conv1D layers (c_proj in both)
ALL_PROJECTIONS = (*PROJECTIONS, "qkv_proj", "gate_up_proj", *FUSED["gpt_neox"], *FUSED["gpt2"])  # every family's
TARGETS = (*ALL_PROJECTIONS, HEAD)
MAX_RANK = 1 << 16
QUANTIZE = ("nf4", "int8")
FREEZABLE = ("embeddings", "head")
SAVABLE = ("embed_tokens", HEAD)  # PEFT's modules_to_save: a trained copy of the module beside the frozen one


@record(frozen=True)
class Finetune:
    """What trains: rank 0 is full training (every weight, or all but the frozen parts); rank r > 0 is LoRA
    over `targets` (Transformers' projection names) with lora_dropout, the base frozen."""

    lora_rank: int = 0
    targets: tuple[str, ...] = PROJECTIONS
    lora_dropout: float = 0.0  # LoraConfig's default (peft/tuners/lora/config.py)
    lora_alpha: int = 8  # LoraConfig's default: scaling = alpha / r, a multiply either way
    quantize: str = ""  # the frozen base's storage: "" (the model's dtype), nf4 or int8 (bitsandbytes)
    freeze: tuple[str, ...] = ()  # full training: "embeddings", "head" frozen
    frozen_blocks: int = 0  # full training: the first N blocks frozen
    dora: bool = False  # LoraConfig(use_dora=True): a trained magnitude per output of each targeted projection
    modules_to_save: tuple[str, ...] = ()  # LoraConfig(modules_to_save=...): SAVABLE modules trained whole, as copies

    @property
    def lora(self) -> bool:
        return self.lora_rank > 0

    @property
    def trains_all(self) -> bool:
        """Every weight trains: plain training, nothing frozen."""
        return not self.lora and not self.freeze and not self.frozen_blocks

    @property
    def lead_blocks(self) -> int:
        """Blocks at the start that run otherwise than the rest: the frozen ones, and the first whose input needs
        no gradient (a frozen embedding's output, LoRA's included), whose ops save less. memcalc.exact.growth
        keeps them in both short steps it grows from, as it keeps dense blocks before MoE ones."""
        if self.lora or "embeddings" in self.freeze:
            return self.frozen_blocks + 1
        return self.frozen_blocks

    @property
    def label(self) -> str:
        """'lora 16', 'qlora nf4 16', 'frozen embeddings, 2 blocks' or '' for full training."""
        if self.lora:
            name = "DoRA" if self.dora else "LoRA"
            saved = f", {' and '.join(self.modules_to_save)} trained" if self.modules_to_save else ""
            return (f"Q{name} ({self.quantize}) r={self.lora_rank}" if self.quantize else
                    f"{name} r={self.lora_rank}") + saved  # fmt: skip
        blocks = f"the first {self.frozen_blocks} block" + ("s" if self.frozen_blocks > 1 else "")
        frozen = list(self.freeze) + ([blocks] if self.frozen_blocks else [])
        return "frozen: " + ", ".join(frozen) if frozen else ""


FULL = Finetune()


def arch_of(shape: ModelShape) -> str:
    """The Transformers architecture whose module names LoRA targets: the shape's, gpt2 for the textbook GPT
    layer read from its fields (ModelShape.family "gpt"), else llama's names."""
    return "gpt2" if shape.family == "gpt" else shape.arch


def projection_shapes(shape: ModelShape) -> dict[str, tuple[int, int]]:
    """(out, in) of each projection of one block, in its modules' order (modeling_llama.py LlamaAttention,
    LlamaMLP; modeling_phi3.py's fused qkv_proj and gate_up_proj; modeling_gpt_neox.py's query_key_value, dense,
    dense_h_to_4h, dense_4h_to_h; modeling_gpt2.py's Conv1D layers by module path)."""
    h, f, arch = shape.hidden, shape.ffn, arch_of(shape)
    if arch == "gpt2":  # keyed by module path: c_proj is the attention's and the MLP's
        return {"attn.c_attn": (3 * h, h), "attn.c_proj": (h, h), "mlp.c_fc": (f, h), "mlp.c_proj": (h, f)}
    if arch == "gpt_neox":
        return {"query_key_value": (3 * h, h), "dense": (h, h), "dense_h_to_4h": (f, h), "dense_4h_to_h": (h, f)}
    if arch == "phi3":
        return {"o_proj": (h, shape.q_dim), "qkv_proj": (shape.q_dim + 2 * shape.kv_dim, h), "gate_up_proj": (2 * f, h),
                "down_proj": (h, f)}  # fmt: skip
    return {"q_proj": (shape.q_dim, h), "k_proj": (shape.kv_dim, h), "v_proj": (shape.kv_dim, h),
            "o_proj": (h, shape.q_dim), "gate_proj": (f, h), "up_proj": (f, h), "down_proj": (h, f)}  # fmt: skip


def targeted(arch: str, finetune: Finetune) -> tuple[str, ...]:
    """The block's projections LoRA wraps on the architecture: all-linear (the targets holding Llama's seven) takes
    every projection of a FUSED block (Phi-3's four, GPT-NeoX's four, GPT-2's three names); named targets are
    taken as named."""
    names = FUSED.get(arch, PROJECTIONS)
    if arch in FUSED and set(PROJECTIONS) <= set(finetune.targets):
        return names
    return tuple(n for n in names if n in finetune.targets)


def peft_targets(arch: str, finetune: Finetune) -> tuple[str, ...]:
    """LoraConfig's target_modules for the architecture: its targeted projections, and lm_head where named."""
    return targeted(arch, finetune) + ((HEAD,) if HEAD in finetune.targets else ())


def missing_targets(arch: str, finetune: Finetune) -> str:
    """Why LoRA's named targets do not fit the architecture's blocks (Phi-3's q, k, v are one qkv_proj; Llama has
    no c_attn), or ""."""
    names = FUSED.get(arch, PROJECTIONS)
    if not finetune.lora or (arch in FUSED and set(PROJECTIONS) <= set(finetune.targets)):
        return ""
    missing = [t for t in finetune.targets if t != HEAD and t not in names]
    return (f"--lora-targets: {arch}'s blocks have no {missing[0]}; their projections are "
            f"{', '.join(n.removesuffix('_proj') for n in names)} (or all-linear)") if missing else ""


def frozen_params(shape: ModelShape, finetune: Finetune) -> int:
    """The weights that do not train: the whole base under LoRA; else the frozen parts (a tied head is the
    embedding's table, counted once)."""
    if finetune.lora:
        return n_params(shape)
    table = shape.vocab * shape.hidden
    tables = ("embeddings" in finetune.freeze) + ("head" in finetune.freeze)
    tables = min(tables, 1) if shape.tied_embeddings else tables
    return tables * table + finetune.frozen_blocks * layer_params(shape)


def trained_params(shape: ModelShape, finetune: Finetune) -> int:
    """What the optimizer holds: LoRA's adapters, or every weight not frozen."""
    return adapter_params(shape, finetune) if finetune.lora else n_params(shape) - frozen_params(shape, finetune)


def nf4_bytes(rows: int, cols: int) -> int:
    """One weight as bitsandbytes 0.50 stores it in 4 bits with double quantisation (functional.quantize_4bit,
    compress_statistics=True): the packed data (n+1)//2, one uint8 absmax per 64 elements, one fp32 absmax per
    256 of those, its own copy of the 256-entry fp32 dynamic map, the 16-entry fp32 nf4 code, the fp32 offset."""
    n = rows * cols
    blocks = -(-n // 64)
    return (n + 1) // 2 + blocks + 4 * -(-blocks // 256) + 4 * 256 + 4 * 16 + 4


def quantized_weights(shape: ModelShape) -> tuple[int, int]:
    """QLoRA's 4-bit weights, every projection of the blocks (transformers/integrations/bitsandbytes.py
    replace_with_bnb_linear: every nn.Linear but lm_head): their count, and their bytes with the shared
    dynamic map (functional.name2qmap, 256 fp32)."""
    dims = projection_shapes(shape).values()
    count = shape.n_layers * sum(r * c for r, c in dims)
    return count, shape.n_layers * sum(nf4_bytes(r, c) for r, c in dims) + 4 * 256


def adapter_params(shape: ModelShape, finetune: Finetune) -> int:
    """LoRA's trainable parameters: r·(in + out) per targeted projection per block, and on the head r·(hidden +
    vocab) (lora_A (r, in), lora_B (out, r): peft/tuners/lora/layer.py LoraLayer.update_layer); DoRA adds a
    magnitude per output (lora_magnitude_vector: DoraLinearLayer.update_layer)."""
    return sum(adapter_sizes(shape, finetune))


def adapter_sizes(shape: ModelShape, finetune: Finetune) -> list[int]:
    """The elements of each adapter tensor, in PEFT's order: lora_A r·in, lora_B out·r (and DoRA's magnitude, out)
    per targeted projection per block, then the head's (adapter_params is their sum)."""
    if not finetune.lora:
        return []
    r = finetune.lora_rank

    def one(out: int, inp: int) -> list[int]:
        return [r * inp, out * r] + ([out] if finetune.dora else [])

    wrapped = targeted(arch_of(shape), finetune)
    block = [n for name, (out, inp) in projection_shapes(shape).items() if name.rpartition(".")[2] in wrapped
             for n in one(out, inp)]  # fmt: skip
    table = shape.vocab * shape.hidden  # a modules_to_save copy of the embedding or the head
    return ([table] if "embed_tokens" in finetune.modules_to_save else []) + block * shape.n_layers + \
        (one(shape.vocab, shape.hidden) if HEAD in finetune.targets else []) + \
        ([table] if HEAD in finetune.modules_to_save else [])  # fmt: skip


def saved_params(shape: ModelShape, finetune: Finetune) -> int:
    """The modules_to_save copies' elements: a vocab x hidden table each (embed_tokens, lm_head)."""
    return len(finetune.modules_to_save) * shape.vocab * shape.hidden if finetune.lora else 0


def unpaged_adapter_params(shape: ModelShape, finetune: Finetune) -> int:
    """The adapters' elements in tensors too small for a paged optimizer to page (memcalc.model.bnb)."""
    return sum(n for n in adapter_sizes(shape, finetune) if n < MIN_PAGED_SIZE) if finetune.lora else 0


def parse_targets(text: str | None) -> tuple[str, ...]:
    """--lora-targets q,k,v,o (or q_proj,...; 'all-linear', the default: every projection of the blocks), and
    lm_head (or head) for the output layer, which all-linear leaves out as PEFT does."""
    if text is None or text.strip().lower() == "all-linear":
        return PROJECTIONS
    names = []
    for item in (x.strip().lower() for x in text.split(",") if x.strip()):
        name = HEAD if item in (HEAD, "head") else item if item in TARGETS or item.endswith("_proj") else item + "_proj"
        if item == "all-linear":
            names += [p for p in PROJECTIONS if p not in names]
            continue
        if name not in TARGETS:
            raise InputError(f"unknown LoRA target {item!r}; the blocks' projections: "
                             f"{', '.join(p.removesuffix('_proj') for p in ALL_PROJECTIONS)} (or all-linear), "
                             "and lm_head")  # fmt: skip
        if name not in names:
            names.append(name)
    if not names:
        raise InputError("--lora-targets names no projection")
    return tuple(p for p in TARGETS if p in names)  # PEFT wraps them in the modules' order


def parse_freeze(text: str | None) -> tuple[tuple[str, ...], int]:
    """--freeze embeddings,head,N: the parts frozen, and how many blocks from the first."""
    parts, blocks = [], 0
    for item in (x.strip().lower() for x in (text or "").split(",") if x.strip()):
        if item.isdigit():
            if blocks:
                raise InputError(f"--freeze takes one number of blocks (the first N), got {blocks} and {item}")
            blocks = int(item)
        elif item in FREEZABLE:
            parts.append(item)
        else:
            raise InputError(f"--freeze takes {', '.join(FREEZABLE)} and a number of blocks, got {item!r}")
    return tuple(p for p in FREEZABLE if p in parts), blocks


def parse_saved(text: str | None) -> tuple[str, ...]:
    """--modules-to-save embed_tokens,lm_head (PEFT's module names; embeddings and head too)."""
    names = []
    for item in (x.strip().lower() for x in (text or "").split(",") if x.strip()):
        name = {"embeddings": "embed_tokens", "head": HEAD}.get(item, item)
        if name not in SAVABLE:
            raise InputError(f"--modules-to-save takes {' and '.join(SAVABLE)}, got {item!r}")
        names.append(name)
    return tuple(n for n in SAVABLE if n in names)


def finetune_for(lora: str | None = None, targets: str | None = None, dropout: str | None = None,
                 quantize: str | None = None, freeze: str | None = None, dora: bool = False,
                 modules_to_save: str | None = None) -> Finetune:  # fmt: skip
    """The CLI's options as one record; options that do not apply refused in one line."""
    from .sizes import parse_count

    rank = 0 if lora is None else parse_count(lora, "lora", MAX_RANK)
    if not rank:
        for flag, value in (("--lora-targets", targets), ("--lora-dropout", dropout), ("--quantize", quantize),
                            ("--dora", dora or None), ("--modules-to-save", modules_to_save)):  # fmt: skip
            if value is not None:
                raise InputError(f"{flag} is an option of LoRA: give --lora R (QLoRA is --lora R --quantize nf4)")
    q = (quantize or "").strip().lower()
    if q and q not in QUANTIZE:
        raise InputError(f"unknown --quantize {quantize!r}; known: {', '.join(QUANTIZE)}")
    frozen, blocks = parse_freeze(freeze)
    if rank and (frozen or blocks):
        raise InputError("--freeze is for full training: LoRA already freezes every base weight")
    p = 0.0
    if dropout is not None:
        try:
            p = float(dropout)
        except ValueError:
            raise InputError(f"--lora-dropout must be a number in [0, 1), got {dropout!r}") from None
        if not 0 <= p < 1:
            raise InputError(f"--lora-dropout must be a number in [0, 1), got {dropout!r}")
    if dora and q:
        raise InputError("--dora with --quantize: DoRA over a 4-bit base is not replayed (PEFT dequantizes each "
                         "weight for its norm); give --dora over a 16-bit base")  # fmt: skip
    saved, aimed = parse_saved(modules_to_save), parse_targets(targets)
    if HEAD in saved and HEAD in aimed:
        raise InputError("lm_head is both a LoRA target and in --modules-to-save: PEFT wraps a module one way")
    return Finetune(rank, aimed, p, quantize=q, freeze=frozen, frozen_blocks=blocks, dora=dora, modules_to_save=saved)
