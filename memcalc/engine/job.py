"""What is asked: one Job. The CLI parses options into it; memcalc.engine.answer answers it."""

from __future__ import annotations

from memcalc.errors import InputError
from memcalc.memory.setup import Setup, group_rows
from memcalc.model.finetune import HEAD
from memcalc.model.gpus import GPU, check_precision
from memcalc.model.layout import ONE_GPU, Layout
from memcalc.model.rl import TRAINERS, second_model
from memcalc.model.shape import Model
from memcalc.model.stacks import FUSED_HEAD
from memcalc.model.tricks import PROGRESSION, Tricks
from memcalc.parallel.verdict import sharded_data_parallel
from memcalc.records import record
from memcalc.time.calibration import Calibration, calibration_for


@record(frozen=True)
class Job:
    """Train `model` with `setup` on GPUs of type `gpu` laid out as `layout`, under each trick set.

    setup.micro_batch is one micro-batch, setup.grad_accum the micro-batches each pipeline runs per step;
    the layout, the one record of the GPUs, says how they share the work (--gpus N alone is data parallelism
    over N, the same job as --dp N; the textbook's model state shards as it says). timing: the roofline's
    calibration (None: the GPU's shipped one) or --mfu's end-to-end rate (a float), as given; time_model is
    what times the step."""

    model: Model
    setup: Setup
    gpu: GPU
    layout: Layout = ONE_GPU
    trick_sets: tuple[Tricks, ...] = PROGRESSION
    timing: Calibration | float | None = None
    tokens: int | None = None  # --tokens: the whole run's length
    price: float | None = None  # --price-per-gpu-hour
    exact: bool = False  # --exact: beside the textbook, what PyTorch saves, op by op
    timeline: bool = False  # --timeline: each trick set's step, allocation by allocation

    def __post_init__(self) -> None:
        if not self.trick_sets:
            raise InputError("no trick sets to estimate")
        if self.price is not None and self.tokens is None:
            raise InputError("--price-per-gpu-hour needs --tokens (the length of the run)")
        for t in self.trick_sets:
            check_precision(self.gpu, t.precision, t.fp8_name)
        check_finetune(self.model, self.setup, self.layout, self.trick_sets)

    @property
    def data_parallel(self) -> bool:
        return data_parallel(self.layout)

    @property
    def time_model(self) -> Calibration | float:
        """How the step is timed: --mfu's rate as given; else the roofline at the calibration (the GPU's shipped
        one by default), where memcalc.exact traces the shape's kernels, and setup.mfu where it does not."""
        if isinstance(self.timing, float):
            return self.timing
        from memcalc.time.roofline import traceable

        if not traceable(self.model.shape):
            return self.setup.mfu
        return self.timing if self.timing is not None else calibration_for(self.gpu.key)


def data_parallel(layout: Layout) -> bool:
    """Whether every GPU runs the whole model (no tensor, pipeline, context or expert parallel): the
    textbook's whole-model terms, the toolbox and sweeps apply."""
    return layout.tp == layout.pp == layout.cp == layout.ep == layout.etp == 1


def plain_split(lay: Layout) -> bool:
    """No tensor, pipeline, context or expert parallel and nothing offloaded."""
    return max(lay.tp, lay.pp, lay.cp, lay.ep, lay.etp) == 1 and not (lay.offload_optimizer or lay.offload_params)


def check_finetune(model: Model, setup: Setup, lay: Layout, trick_sets: tuple[Tricks, ...] = ()) -> None:
    """LoRA and frozen weights (memcalc.model.finetune) are replayed on one GPU, or each GPU of plain data
    parallelism (every GPU holds the whole model and its adapters); sharded, split or offloaded, refused (Liger's
    kernels, full training too, with the weights whole: ZeRO 0-2). The
    replay is their only account (the textbook's layouts and the traced kernels are full training's), so a
    recipe or optimizer it does not run with them is refused too, with its reason."""
    ft = setup.stack.finetune
    if setup.stack.savers.liger is not None and not (plain_split(lay) and lay.zero < 3):
        raise InputError("--liger is replayed on one GPU, or each GPU of data parallelism with the weights whole "
                         "(ZeRO 0-2): lce_forward reads lm_head.weight outside the head's forward, where ZeRO-3's and "
                         "FSDP2's gathers are not replayed with it")  # fmt: skip
    reads_head = "its fused LM head" if setup.stack.trl in FUSED_HEAD else (
        "its loss_type chunked_nll" if setup.stack.loss == "chunked_nll" else "")
    if reads_head and not (plain_split(lay) and lay.zero < 3):
        raise InputError(f"--stack {setup.stack.key} is replayed on one GPU, or each GPU of data parallelism with the "
                         f"weights whole (ZeRO 0-2): {reads_head} reads lm_head.weight outside the head's forward "
                         "(FSDP2's full_tensor, ZeRO-3's gather around it), which is not replayed")  # fmt: skip
    if setup.stack.rl == "ppo" and not (plain_split(lay) and lay.zero == 0):
        raise InputError("--rl ppo is replayed on one GPU, or each GPU of plain data parallelism: PPOTrainer prepares "
                         "its reward and reference models as DeepSpeed engines of their own under ZeRO (trl "
                         "prepare_deepspeed), and gathers ZeRO-3's weights to generate, which is not replayed")  # fmt: skip
    if second_model(setup.stack) and lay.zero:
        rl = setup.stack.rl
        trainer, fix = TRAINERS[rl], "--precompute-ref" if rl == "dpo" else "--beta 0"
        raise InputError(f"--rl {rl} on a model that is not PEFT's under --zero: {trainer} prepares its second model "
                         "as a DeepSpeed engine of its own (trl prepare_deepspeed: stage 0 below ZeRO-3, in the "
                         f"engine's bf16), which is not replayed; {fix}, --lora, or --zero 0")  # fmt: skip
    if setup.micro_batch % group_rows(setup, lay.world):
        generated = setup.micro_batch * setup.grad_accum * lay.world  # generation_batch_size's default
        raise InputError(f"GRPOConfig refuses a generation batch of {generated} (micro-batch x accumulation x GPUs) "
                         f"with --num-generations {setup.stack.online.num_generations}: it must hold whole prompt "
                         "groups (generation_batch_size % num_generations == 0)")  # fmt: skip
    if setup.stack.model == "torchtune" and not (plain_split(lay) and lay.zero == 0):  # its single-device recipes
        raise InputError("--stack torchtune replays its single-device recipes (full_finetune_single_device, "
                         "lora_finetune_single_device): one GPU, or each GPU of plain data parallelism")  # fmt: skip
    if ft.trains_all:
        return
    from memcalc.exact.base.config import not_replayed

    stack = setup.stack
    for t in trick_sets:
        why = not_replayed(stack.model, stack.recipe, stack.impl, setup.optimizer, t.precision)
        if why:
            raise InputError(f"{ft.label}: {why}")
    if stack.engine == "fsdp2" and not sharded_data_parallel(lay, "fsdp2") and plain_split(lay):
        raise InputError(f"{ft.label} under --stack fsdp2 is fully_shard over 2 or more GPUs: give --gpus N "
                         "--zero 3 (--stack hf for one GPU or plain data parallelism)")  # fmt: skip
    if not sharded_data_parallel(lay):
        raise InputError(f"{ft.label} is replayed on one GPU, or each GPU of data parallelism, sharded or not "
                         "(ZeRO 1-3, FSDP); offload, tensor, pipeline, context and expert parallel are not replayed "
                         "with it")  # fmt: skip
    from memcalc.exact.hf.model import arch_for, finetune_not_replayed
    from memcalc.exact.torchtune.model import finetune_not_replayed as torchtune_not_replayed

    why = (torchtune_not_replayed(ft, model.shape) if stack.model == "torchtune" else
           finetune_not_replayed(ft, arch_for(model.shape), "hf"))  # a mixture of experts or latent attention
    if why:
        raise InputError(why)
    whole_base_hf = stack.model == "hf" and stack.engine != "fsdp2" and lay.zero < 3  # PEFT's model, unsharded
    if ft.dora and not whole_base_hf:
        raise InputError("--dora is replayed as PEFT runs it on Transformers' classes (--stack hf), the base whole on "
                         "every GPU (ZeRO 0-2): under FSDP or ZeRO-3 each weight is gathered for its norm, which is "
                         "not replayed")  # fmt: skip
    if ft.modules_to_save and not whole_base_hf:
        raise InputError("--modules-to-save is replayed as PEFT runs it on Transformers' classes (--stack hf), the "
                         "base whole on every GPU (ZeRO 0-2)")  # fmt: skip
    if ft.modules_to_save and model.shape.tied_embeddings:
        raise InputError(f"--modules-to-save: {model.shape.name or 'the model'}'s head is its embedding table (tied): "
                         "PEFT's copies of a shared table are not replayed")  # fmt: skip
    if HEAD in ft.targets and model.shape.tied_embeddings:
        raise InputError(f"--lora-targets lm_head: {model.shape.name or 'the model'}'s head is its embedding table "
                         "(tied): LoRA on it is not replayed (PEFT wraps the shared module, torchtune refuses "
                         "apply_lora_to_output with tie_word_embeddings); target the blocks' projections")  # fmt: skip
    if ft.frozen_blocks >= model.shape.n_layers:
        raise InputError(f"--freeze {ft.frozen_blocks}: {model.shape.name or 'the model'} has "
                         f"{model.shape.n_layers} blocks; leave one to train")  # fmt: skip

