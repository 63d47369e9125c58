"""The options the commands share, in groups as the engine's records are: the model (ModelOptions -> Model), whose
code trains it (StackOptions -> Stack), the step (StepOptions -> Setup), how the GPUs share it (LayoutOptions ->
Layout) and the card (GpuOptions -> GPU). A command reads each group out of its options by name,
`ModelOptions.of(options)` with `options = locals()` taken before anything else is bound, and each group parses
its options into its record here, once for every command that takes them.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

from memcalc.errors import InputError, subject
from memcalc.model.presets import MAX_PARAMS, PRESETS, canonical_model, gpt, preset_model
from memcalc.model.shape import MAX_SIZE, Model, longest_seq, n_params, override, parse_count
from memcalc.model.sizes import parse_fraction, parse_positive

DEFAULT_SEQ = 4096


class OptionGroup:
    @classmethod
    def of(cls, options: dict, **given):
        """This group's options out of a command's, by name (a command that lacks one leaves its default), with
        `given` in place of the command's own where an option of the same name means something else there."""
        return cls(**{f.name: options[f.name] for f in fields(cls) if f.name in options} | given)


@dataclass(frozen=True)
class ModelOptions(OptionGroup):
    """--params N | --model NAME | --config PATH, then --layers --hidden --heads --kv-heads --ffn --vocab."""

    params: str | None = None
    model: str | None = None
    config: str | None = None
    layers: str | None = None
    hidden: str | None = None
    heads: str | None = None
    kv_heads: str | None = None
    ffn: str | None = None
    vocab: str | None = None

    @property
    def given(self) -> bool:
        """Whether any option names a model (verify --step measures its own without one)."""
        return any(x is not None for x in (self.params, self.model, self.config, self.layers, self.hidden, self.heads))

    def resolve(self) -> Model:
        """With --params the parameter count stays N whatever the overrides; otherwise it is the shape's own.
        With none of the three, --layers, --hidden and --heads describe a GPT-style model."""
        chosen = [flag for flag, value in (("--params", self.params), ("--model", self.model),
                                           ("--config", self.config)) if value]  # fmt: skip
        if len(chosen) > 1:
            raise InputError(f"give one of --params, --model, --config, not {' and '.join(chosen)}")
        sizes = {"n_layers": optional_count(self.layers, "layers"), "hidden": optional_count(self.hidden, "hidden"),
                 "n_heads": optional_count(self.heads, "heads"), "n_kv_heads": optional_count(self.kv_heads, "kv-heads"),
                 "ffn": optional_count(self.ffn, "ffn"), "vocab": optional_count(self.vocab, "vocab")}  # fmt: skip
        if self.params:
            base = canonical_model(parse_count(self.params, "params", MAX_PARAMS))
            return Model(override(base.shape, **sizes), base.n_params, base.origin + overrides_note(sizes))
        if self.model or self.config:
            base = named_model(self.model, self.config)
            shape = override(base.shape, **sizes)
            return Model(shape, n_params(shape), base.origin + overrides_note(sizes))
        if None in (sizes["n_layers"], sizes["hidden"], sizes["n_heads"]):
            raise InputError("say which model: --params N, --model NAME, --config PATH, or --layers --hidden --heads")
        base = gpt("custom", sizes["n_layers"], sizes["hidden"], sizes["n_heads"], 0)
        shape = replace(base, **{k: v for k, v in sizes.items() if v is not None})
        origin = "custom GPT-style shape from --layers --hidden --heads (GPT-2/3 layer, no position table)"
        return Model(shape, n_params(shape), origin)


def named_model(model: str | None, config: str | None) -> Model:
    """--model: a preset or a Hub id; --config: a config.json or a Hub id."""
    from memcalc.model.hfconfig import config_model, hub_model  # here: only these read a config.json
    from memcalc.model.hub import is_hub_id

    if model:
        return hub_model(model) if model.strip().lower() not in PRESETS and is_hub_id(model) else preset_model(model)
    return hub_model(config) if is_hub_id(config) else config_model(config)


def optional_count(text: str | None, name: str, limit: float = float(MAX_SIZE)) -> int | None:
    return None if text is None else parse_count(text, name, limit)


def overrides_note(sizes: dict[str, int | None]) -> str:
    given = ", ".join(f"{k} {v}" for k, v in sizes.items() if v is not None)
    return f", overridden: {given}" if given else ""


def seq_for(seq: str | None, model: Model | None) -> str:
    """--seq as given; without it 4096 tokens, or the model's learned position table where that is shorter
    (GPT-2: 1,024), so that `--model gpt2` runs as it is."""
    if seq is not None:
        return seq
    return str(DEFAULT_SEQ if model is None else min(DEFAULT_SEQ, longest_seq(model.shape)))


@dataclass(frozen=True)
class StackOptions(OptionGroup):
    """--stack, --recipe, --optimizer-impl, --no-cache, --offload-activations, --liger, --reentrant, the fine-tuning
    (--lora, --lora-targets, --lora-dropout, --dora, --modules-to-save, --quantize, --freeze) and RL's: --rl,
    --precompute-ref, and GRPOConfig's and RLOOConfig's --completion-len, --num-generations, --beta, --vllm,
    --vllm-util, --vllm-sleep, --vllm-max-len, --cudagraph-memory."""

    stack: str | None = None
    recipe: str | None = None
    optimizer_impl: str | None = None
    no_cache: bool = False
    offload_activations: bool = False
    lora: str | None = None
    lora_targets: str | None = None
    lora_dropout: str | None = None
    dora: bool = False
    modules_to_save: str | None = None
    quantize: str | None = None
    freeze: str | None = None
    loss: str | None = None
    optimizer_in_backward: bool = False
    liger: bool = False
    reentrant: bool = False
    rl: str | None = None
    precompute_ref: bool = False
    completion_len: str | None = None
    num_generations: str | None = None
    beta: str | None = None
    vllm: str | None = None
    vllm_util: str | None = None
    vllm_sleep: bool = False
    vllm_max_len: str | None = None
    cudagraph_memory: str | None = None
    critic: str | None = None
    rollout_batch: str | None = None

    def online(self, line: str = ""):
        """GRPOConfig's (and RLOOConfig's) settings (memcalc.model.rl.OnlineRL) where any is given or --rl grpo or rloo
        is, each trainer's defaults where not given; else None."""
        from memcalc.model.rl import COMPLETION_DEFAULT, ONLINE, RLOO_DEFAULTS, SERVE_UTILIZATION, OnlineRL
        from memcalc.model.sizes import parse_count, parse_seq

        from .serve import graph_bytes

        given = (self.completion_len, self.num_generations, self.beta, self.vllm, self.vllm_util, self.vllm_max_len,
                 self.cudagraph_memory)  # fmt: skip
        rl = (self.rl or "").strip().lower()
        if rl == "ppo":  # PPOConfig's response_length is --completion-len (ppo()); the rest are GRPOConfig's
            if any(x is not None for x in given[1:]) or self.vllm_sleep:
                raise InputError("--num-generations, --beta and the --vllm options are GRPOConfig's and RLOOConfig's; "
                                 "--rl ppo (PPOConfig, no vLLM) takes --completion-len")  # fmt: skip
            return None
        if all(x is None for x in given) and not self.vllm_sleep and rl not in ONLINE:
            return None
        base = RLOO_DEFAULTS if rl == "rloo" else OnlineRL(COMPLETION_DEFAULT.get(line, OnlineRL.completion_len))
        if self.vllm_util is not None and self.vllm is None:
            raise InputError("--vllm-util is vllm_gpu_memory_utilization: give --vllm colocate or server")
        mode = (self.vllm or "").strip().lower()
        util = SERVE_UTILIZATION if mode == "server" else base.vllm_util  # trl vllm-serve's, or GRPOConfig's
        completion = base.completion_len if self.completion_len is None else parse_seq(self.completion_len,
                                                                                       "--completion-len")
        generations = base.num_generations if self.num_generations is None else parse_count(self.num_generations,
                                                                                             "--num-generations")
        max_len = 0 if self.vllm_max_len is None else parse_seq(self.vllm_max_len, "--vllm-max-len")
        return OnlineRL(completion, generations, base.beta if self.beta is None else parse_beta(self.beta), mode,
                        util if self.vllm_util is None else parse_fraction(self.vllm_util, "--vllm-util"),
                        self.vllm_sleep, max_len, graph_bytes(self.cudagraph_memory) or 0)  # fmt: skip

    def ppo(self):
        """PPOConfig's settings (memcalc.model.rl.Ppo) under --rl ppo: --completion-len its response_length,
        --rollout-batch its local_rollout_forward_batch_size, --critic the value and reward models, the rest its
        defaults; else None."""
        from memcalc.model.rl import Ppo
        from memcalc.model.sizes import parse_count, parse_seq

        if (self.rl or "").strip().lower() != "ppo":
            if self.critic is not None or self.rollout_batch is not None:
                raise InputError("--critic and --rollout-batch are PPOConfig's: give --rl ppo")
            return None
        base = Ppo()
        completion = base.completion_len if self.completion_len is None else parse_seq(self.completion_len,
                                                                                       "--completion-len")
        rows = base.rollout_batch if self.rollout_batch is None else parse_count(self.rollout_batch, "--rollout-batch")
        return Ppo(completion, rows, critic=None if self.critic is None else named_model(self.critic, None).shape)

    def resolve(self, gpu=None):
        """PEFT and frozen weights are replayed on Transformers' classes, so hf is the default there and any other
        stack is refused; without them, reference is the default (memcalc.model.finetune.finetune_for); under --rl
        dpo, trl:1.16 (its DPOTrainer is replayed there and on trl:1.5 to trl:1.13); under --rl grpo or rloo trl:1.16
        too; --loss is refused under --rl. --liger allocates by the GPU's kind (memcalc.model.savers.liger_for);
        without a GPU (verify), as on meta."""
        from memcalc.model.finetune import finetune_for
        from memcalc.model.rl import PPO_LINE, TRAINERS, liger_refused, with_rl
        from memcalc.model.savers import ON_META, liger_for
        from memcalc.model.stacks import DPO_LOGITS, FUSED_HEAD, GRPO_LOGITS, stack_for, with_loop

        finetune = finetune_for(self.lora, self.lora_targets, self.lora_dropout, self.quantize, self.freeze, self.dora,
                                self.modules_to_save)  # fmt: skip
        liger = (liger_for(gpu) if gpu is not None else ON_META) if self.liger else None
        rl = (self.rl or "").strip().lower()
        trainer = rl in TRAINERS  # TRL's trainers: the line they are replayed on
        default = f"trl:{PPO_LINE if rl == 'ppo' else FUSED_HEAD[-1]}" if trainer else (
            "reference" if finetune.trains_all else "hf")
        if rl == "ppo" and (self.recipe or "pure").strip().lower() != "pure":
            raise InputError(f"--rl ppo with --recipe {self.recipe}: PPOTrainer builds its Accelerator without "
                             "mixed_precision, so the models train in the dtype they are loaded in (--recipe pure)")
        key = (self.stack or "").strip().lower()
        if self.liger and rl == "dpo" and key.removeprefix("trl:") in DPO_LOGITS:  # before stack_for's SFT reason
            raise InputError(f"--liger with --rl dpo on --stack {key}: its DPOTrainer's Liger loss "
                             "(_compute_loss_liger, LigerFusedLinearDPOLoss) is not replayed; on trl:1.16 it is")
        if self.liger and rl == "grpo" and key.removeprefix("trl:") in GRPO_LOGITS:
            raise InputError(liger_refused(key.removeprefix("trl:")))
        chosen = stack_for(self.stack or default, self.recipe,
                           self.optimizer_impl, self.no_cache, self.offload_activations, liger,
                           self.reentrant)  # fmt: skip
        if not finetune.trains_all:
            if chosen.engine == "fsdp2" and finetune.lora:  # PEFT's LoRA model under fully_shard, as accelerate runs it
                chosen = replace(chosen, model="hf", recipe=self.recipe or "pure")  # (memcalc.exact.replay.fsdp2_lora)
            if chosen.model not in ("hf", "torchtune"):
                raise InputError(f"{finetune.label}: LoRA and frozen weights are replayed on Transformers' classes "
                                 f"wrapped by PEFT (--stack hf) and torchtune's (--stack torchtune), not --stack "
                                 f"{chosen.key}")  # fmt: skip
            chosen = replace(chosen, finetune=finetune)
        if trainer and self.loss is not None:  # DPOTrainer and the online trainers compute their own loss
            raise InputError(f"--loss is SFTTrainer's loss_type (and torchtune's loss); --rl {rl} trains with "
                             f"{TRAINERS[rl]}'s own loss")  # fmt: skip
        return with_rl(with_loop(chosen, self.loss, self.optimizer_in_backward), self.rl, self.precompute_ref,
                       self.online(chosen.trl), self.ppo())  # fmt: skip


@dataclass(frozen=True)
class StepOptions(OptionGroup):
    """--seq, --micro-batch, --grad-accum, --optimizer, --mfu, --host-memory, and a mixture of experts' routing:
    --capacity-factor, --expert-imbalance."""

    seq: str | None = None
    micro_batch: str = "1"
    grad_accum: str = "1"
    optimizer: str = "adamw"
    mfu: str | None = None
    host_memory: str = "2T"
    capacity_factor: str | None = None
    expert_imbalance: str | None = None

    def resolve(self, model: Model | None, stack):
        """The step the model trains with the stack (seq: --seq, else seq_for's default for the model)."""
        from memcalc.memory.setup import DEFAULT_MFU, MAX_HOST_BYTES, Setup, per_sample_of
        from memcalc.memory.state import OPTIMIZERS
        from memcalc.model.shape import MAX_BATCH, parse_seq

        if self.optimizer.strip().lower() not in OPTIMIZERS:
            raise InputError(f"unknown optimizer {self.optimizer!r}; known: {', '.join(OPTIMIZERS)}")
        return Setup(
            seq_len=parse_seq(seq_for(self.seq, model)),
            micro_batch=parse_count(self.micro_batch, "micro-batch", MAX_BATCH) * per_sample_of(stack),  # sequences
            grad_accum=parse_count(self.grad_accum, "grad-accum", MAX_BATCH),
            optimizer=self.optimizer.strip().lower(),
            mfu=DEFAULT_MFU if self.mfu is None else parse_fraction(self.mfu, "mfu"),
            host_memory=parse_count(self.host_memory, "host-memory", MAX_HOST_BYTES),
            stack=stack,
            routing=self.routing(model),
        )

    def routing(self, model: Model | None):
        """--capacity-factor and --expert-imbalance: the routing assumption of a mixture-of-experts model."""
        from memcalc.model.moe import BALANCED, Routing

        cf, imbalance = self.capacity_factor, self.expert_imbalance
        if cf is None and imbalance is None:
            return BALANCED
        if model is None or not model.shape.is_moe:
            given = [f for f, v in (("--capacity-factor", cf), ("--expert-imbalance", imbalance)) if v is not None]
            raise InputError(f"{subject(given, 'describes', 'describe')} how a mixture of experts routes tokens; "
                             f"{model.shape.name if model else 'the model'} has no experts")  # fmt: skip
        return Routing(None if cf is None else parse_positive(cf, "capacity-factor"),
                       1.0 if imbalance is None else parse_positive(imbalance, "expert-imbalance"))  # fmt: skip


@dataclass(frozen=True)
class LayoutOptions(OptionGroup):
    """--gpus, --tp, --pp, --cp, --dp, --zero, --sp, --vpp, --hybrid, --offload, --offload-params, --gpus-per-node,
    --pp-layers, --reshard, --ep, --etp: one Layout (memcalc.model.layout), --gpus N alone data parallel."""

    gpus: str | None = None
    tp: str | None = None
    pp: str | None = None
    cp: str | None = None
    dp: str | None = None
    zero: str = "0"
    sp: bool = False
    vpp: str | None = None
    hybrid: bool = False
    offload: bool = False
    offload_params: bool = False
    gpus_per_node: str | None = None
    pp_layers: str | None = None
    reshard: bool | None = None
    ep: str | None = None
    etp: str | None = None

    def resolve(self):
        from memcalc.model.layout import layout_for
        from memcalc.model.sizes import MAX_GPUS

        def count(text, name, default):
            return default if text is None else parse_count(text, name, MAX_GPUS)

        if self.zero.strip() not in ("0", "1", "2", "3"):
            raise InputError(f"zero stage must be 0, 1, 2 or 3, got {self.zero!r}")
        ends = (self.pp_layers or "0,0").split(",")
        if len(ends) != 2:
            raise InputError(f"--pp-layers takes FIRST,LAST (0 leaves one to the split), got {self.pp_layers!r}")
        first, last = (parse_count(x, "pp-layers", MAX_GPUS) if x.strip() not in ("", "0") else 0 for x in ends)
        return layout_for(
            gpus=count(self.gpus, "gpus", None), tp=count(self.tp, "tp", 1), pp=count(self.pp, "pp", 1),
            cp=count(self.cp, "cp", 1), dp=count(self.dp, "dp", None), zero=int(self.zero), sp=self.sp,
            vpp=count(self.vpp, "vpp", 1), hybrid=self.hybrid, offload_optimizer=self.offload or self.offload_params,
            offload_params=self.offload_params, gpus_per_node=count(self.gpus_per_node, "gpus-per-node", 8),
            first_layers=first, last_layers=last, reshard_after_forward=self.reshard, ep=count(self.ep, "ep", 1),
            etp=count(self.etp, "etp", 1),
        )  # fmt: skip


@dataclass(frozen=True)
class GpuOptions(OptionGroup):
    """--gpu KEY or FILE.json, --gpu-memory, --headroom, --expandable-segments."""

    gpu: str = "h100-sxm"
    gpu_memory: str | None = None
    headroom: str | None = None
    expandable_segments: bool = False

    def resolve(self):
        """The card, checked whole here (its links, what its headroom leaves) so that a bad file or flag is one
        line before anything is computed."""
        from memcalc.model.gpus import find_gpu
        from memcalc.model.headroom import headroom as headroom_of
        from memcalc.parallel.links import fabric_of

        card = find_gpu(self.gpu, self.gpu_memory, self.headroom, self.expandable_segments)
        fabric_of(card)
        headroom_of(card)
        return card


def parse_beta(text: str) -> float:
    """--beta: GRPOConfig.beta, 0 (no reference) or a positive coefficient."""
    from memcalc.model.sizes import parse_positive

    return 0.0 if text.strip() in ("0", "0.0") else parse_positive(text, "--beta")
