"""The options the commands share, as typer reads them: each one's flag, help and metavar, once.

No `from __future__ import annotations` here: typer reads every option's annotation, and string
annotations cost it an eval each, 10 ms at every start for the ~100 options of the commands.
"""

from typing import Annotated, Optional

import typer

Params = Annotated[Optional[str], typer.Option("--params", help="Parameter count (8e9, 70B); the shape comes from the canonical table.", metavar="N")]  # fmt: skip
ModelName = Annotated[Optional[str], typer.Option("--model", help="A preset (see `memcalc presets`), or a Hugging Face Hub id ORG/NAME: its config.json from the local cache, else downloaded alone.", metavar="NAME")]  # fmt: skip
ConfigPath = Annotated[Optional[str], typer.Option("--config", help="A Hugging Face config.json (a path, or a Hub id ORG/NAME as with --model).", metavar="PATH")]  # fmt: skip
Layers = Annotated[Optional[str], typer.Option("--layers", help="Override the number of layers.", metavar="N")]
Hidden = Annotated[Optional[str], typer.Option("--hidden", help="Override the hidden size.", metavar="N")]
Heads = Annotated[Optional[str], typer.Option("--heads", help="Override the attention heads.", metavar="N")]
KvHeads = Annotated[Optional[str], typer.Option("--kv-heads", help="Override the KV heads (GQA).", metavar="N")]
Ffn = Annotated[Optional[str], typer.Option("--ffn", help="Override the MLP width.", metavar="N")]
Vocab = Annotated[Optional[str], typer.Option("--vocab", help="Override the vocabulary size.", metavar="N")]
Seq = Annotated[Optional[str], typer.Option("--seq", help="Sequence length in tokens; k and m are binary (8k = 8,192).", metavar="N", show_default="4096, or the model's position table if shorter")]  # fmt: skip
MicroBatch = Annotated[str, typer.Option("--micro-batch", help="Sequences per forward/backward pass.", metavar="N")]
GradAccum = Annotated[str, typer.Option("--grad-accum", help="Micro-batches accumulated per optimizer step.", metavar="N")]  # fmt: skip
TricksOpt = Annotated[Optional[list[str]], typer.Option("--tricks", help="One combination of fp32, fp16, bf16, fp8 and fp8:rowwise (torchao float8 linears), fp8:te (Transformer Engine, delayed scaling), flash, compile (torch.compile's fused kernels: time), ckpt, ckpt:N (every Nth block), selective, sac (torchtitan's per-op policy) (comma-separated); repeat --tricks for several side by side. Default: the progression fp32 -> bf16 -> +flash -> +ckpt, and bf16+selective.", metavar="LIST")]  # fmt: skip
Optimizer = Annotated[str, typer.Option("--optimizer", help="adamw, sgd (with momentum), or bitsandbytes' adam8bit (AdamW8bit), paged-adam8bit (PagedAdamW8bit), paged-adamw (PagedAdamW: fp32 state).", metavar="NAME")]  # fmt: skip
Gpus = Annotated[Optional[str], typer.Option("--gpus", help="GPUs: data-parallel GPUs that ZeRO shards over; with --tp/--pp/--cp/--dp the world size.", metavar="N", show_default="1")]  # fmt: skip
DataParallelGpus = Annotated[str, typer.Option("--gpus", help="Data-parallel GPUs that ZeRO shards over.", metavar="N")]
Tp = Annotated[Optional[str], typer.Option("--tp", help="Tensor-parallel GPUs per layer.", metavar="N")]
Pp = Annotated[Optional[str], typer.Option("--pp", help="Pipeline stages.", metavar="N")]
Cp = Annotated[Optional[str], typer.Option("--cp", help="Context-parallel GPUs per sequence (needs flash).", metavar="N")]  # fmt: skip
Dp = Annotated[Optional[str], typer.Option("--dp", help="Data-parallel replicas (default: what --gpus leaves).", metavar="N")]  # fmt: skip
Ep = Annotated[Optional[str], typer.Option("--ep", help="Expert-parallel GPUs: each holds 1/N of a MoE layer's experts (within tp x cp x dp).", metavar="N")]  # fmt: skip
Etp = Annotated[Optional[str], typer.Option("--etp", help="Expert tensor parallel: each expert's MLP split over N GPUs.", metavar="N")]  # fmt: skip
Sp = Annotated[bool, typer.Option("--sp", help="Sequence parallel on the TP group.")]
Vpp = Annotated[Optional[str], typer.Option("--vpp", help="Virtual pipeline stages per GPU (interleaved 1F1B).", metavar="N")]  # fmt: skip
Hybrid = Annotated[bool, typer.Option("--hybrid", help="Shard inside a node, replicate across nodes (FSDP hybrid).")]
OffloadParams = Annotated[bool, typer.Option("--offload-params", help="Weights and gradients in host memory too (ZeRO-3).")]  # fmt: skip
GpusPerNode = Annotated[Optional[str], typer.Option("--gpus-per-node", help="GPUs behind one NVLink switch.", metavar="N", show_default="8")]  # fmt: skip
Zero = Annotated[str, typer.Option("--zero", help="ZeRO stage 0, 1, 2 or 3.", metavar="STAGE")]
Offload = Annotated[bool, typer.Option("--offload", help="Offload optimizer state (fp32 master + moments) to CPU memory.")]  # fmt: skip
HostMemory = Annotated[str, typer.Option("--host-memory", help="CPU memory of one node in bytes (2T, 1.5e12), which offload fills; the job's GPUs on a node share it. Default: a DGX H100/H200's 2 TB for 8 GPUs.", metavar="BYTES")]  # fmt: skip
NoOffload = Annotated[bool, typer.Option("--no-offload", help="Leave CPU offload out of the search.")]
Without = Annotated[Optional[str], typer.Option("--without", help="Features to leave out of the search, as a stack that lacked them: sp, interleave, cp, zero, hybrid, offload (a 2021 Megatron-LM run: sp,zero).", metavar="LIST")]  # fmt: skip
GpuOpt = Annotated[str, typer.Option("--gpu", help="GPU type (see `memcalc gpus`), or a JSON file describing one (docs/gpus.md).", metavar="KEY|FILE")]  # fmt: skip
GpuMemory = Annotated[Optional[str], typer.Option("--gpu-memory", help="Use at most this much of each GPU (24GB, 22.5GiB): a card shared, or one not in the table.", metavar="SIZE")]  # fmt: skip
ExpandableSegments = Annotated[bool, typer.Option("--expandable-segments", help="Run with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True: the caching allocator grows one segment per stream by pages. See docs/gpus.md.")]  # fmt: skip
HeadroomOpt = Annotated[Optional[str], typer.Option("--headroom", help="What each verdict keeps back of the GPU beyond the tensors: a size (2GB) in place of memcalc's account (CUDA context, cuBLAS, NCCL, allocator 5%), or the allocator's share (10%); 0: none. See docs/gpus.md.", metavar="SIZE|%")]  # fmt: skip
EstimateMfu = Annotated[Optional[str], typer.Option("--mfu", help="Time the step as hardware FLOPs / (X · peak) instead of by the roofline: X is an end-to-end rate, so a layout adds no bubble or communication to it.", metavar="X")]  # fmt: skip
Calibration = Annotated[Optional[str], typer.Option("--calibration", help="The roofline's efficiencies: a calibration JSON, NAME=X overrides (matmul, flash, bandwidth, vector, launch_us, matmul_dim), or both: my.json,matmul=0.7. Default: the file shipped for --gpu, else memcalc's defaults.", metavar="SPEC")]  # fmt: skip
Format = Annotated[str, typer.Option("--format", help="table, json, markdown or csv.", metavar="FMT")]
Units = Annotated[str, typer.Option("--units", help="gb (decimal, as GPU datasheets count) or gib (binary).", metavar="UNITS")]
StackOpt = Annotated[Optional[str], typer.Option("--stack", help="Whose code trains: reference (memcalc's loop, the default), torch (torch.autocast + torch.optim), hf (Hugging Face Transformers' Trainer: the default with --lora or --freeze); over many GPUs fsdp2 (torchtitan), megatron (Megatron-LM), deepspeed (DeepSpeed ZeRO). See docs/stacks.md and docs/parallel.md.", metavar="NAME", show_default="reference")]  # fmt: skip
Lora = Annotated[Optional[str], typer.Option("--lora", help="LoRA of rank R (PEFT's LoraConfig(r=R)): the base frozen, fp32 adapters on --lora-targets. See docs/finetune.md.", metavar="R")]  # fmt: skip
LoraTargets = Annotated[Optional[str], typer.Option("--lora-targets", help="The projections LoRA wraps: q,k,v,o,gate,up,down (Phi-3: qkv,o,gate_up,down), or all-linear (PEFT's: every linear of the blocks, not lm_head); lm_head adds the output layer.", metavar="LIST", show_default="all-linear")]  # fmt: skip
Dora = Annotated[bool, typer.Option("--dora", help="DoRA, PEFT's LoraConfig(use_dora=True): a trained magnitude per output, and at each forward the weight's norm from whole fp32 matrices (the hf stack; ZeRO 0-2, not FSDP or ZeRO-3).")]  # fmt: skip
ModulesToSave = Annotated[Optional[str], typer.Option("--modules-to-save", help="PEFT's modules_to_save: embed_tokens and/or lm_head trained whole, as copies beside the frozen originals (with their gradients and optimizer state).", metavar="LIST")]  # fmt: skip
LoraDropout = Annotated[Optional[str], typer.Option("--lora-dropout", help="LoraConfig's lora_dropout: above 0, nn.Dropout on each adapter's input saves its mask.", metavar="P", show_default="0")]  # fmt: skip
Quantize = Annotated[Optional[str], typer.Option("--quantize", help="With --lora: the frozen base stored by bitsandbytes, nf4 (QLoRA, double quantisation) or int8.", metavar="FMT")]  # fmt: skip
LossOpt = Annotated[Optional[str], typer.Option("--loss", help="How the logits become the loss: full (cross-entropy over the whole logits; TRL's loss_type nll, also spelt nll), chunked (torchtune's CEWithChunkedOutputLoss, 8 chunks, each upcast to fp32; --stack torchtune's default) or chunked_nll (TRL's loss_type chunked_nll, 256 positions per checkpointed chunk; --stack trl:1.7 to trl:1.14's default).", metavar="NAME")]  # fmt: skip
ReentrantOpt = Annotated[bool, typer.Option("--reentrant", help="With ckpt on --stack hf or trl: gradient_checkpointing_kwargs={'use_reentrant': True}, torch.utils.checkpoint's reentrant CheckpointFunction (axolotl's default). See docs/finetune.md.")]  # fmt: skip
RlOpt = Annotated[Optional[str], typer.Option("--rl", help="Preference and online RL training as TRL 1.16 runs them: dpo (DPOTrainer: --micro-batch counts pairs, each a chosen and a rejected sequence; the reference is the LoRA model with its adapters disabled, or a second copy of a fully trained model), grpo (GRPOTrainer; also --stack trl:1.9 to trl:1.13) or rloo (RLOOTrainer): --micro-batch counts completions, --seq is prompt and completion, with the engine beside the trainer under --vllm; ppo: TRL 1.3-1.12's PPOTrainer (--stack trl:1.12; a value model trained beside the policy, each update's rollout as phases). See docs/rl.md.", metavar="ALGO")]  # fmt: skip
CompletionLen = Annotated[Optional[str], typer.Option("--completion-len", help="With --rl grpo: GRPOConfig's max_completion_length, each sequence's last positions (--seq is prompt and completion together; only the completion is scored). Default 512.", metavar="N")]  # fmt: skip
NumGenerations = Annotated[Optional[str], typer.Option("--num-generations", help="With --rl grpo: completions per prompt (GRPOConfig's num_generations, default 8): the generation batch (--micro-batch x --grad-accum per GPU) is a multiple of it over the GPUs.", metavar="N")]  # fmt: skip
CriticOpt = Annotated[Optional[str], typer.Option("--critic", help="With --rl ppo: the value and reward models (AutoModelForSequenceClassification), a preset or a Hub id, which must share the policy's tokenizer (PPOTrainer scores the policy's token ids with it; its embedding is its own size). Default: the policy's model. See docs/rl.md.", metavar="MODEL")]  # fmt: skip
RolloutBatch = Annotated[Optional[str], typer.Option("--rollout-batch", help="With --rl ppo: PPOConfig's local_rollout_forward_batch_size, the rows generated and scored at once (default 64; the rollout's reference logits grow with it). See docs/rl.md.", metavar="N")]  # fmt: skip
BetaOpt = Annotated[Optional[str], typer.Option("--beta", help="With --rl grpo: the KL coefficient (default 0.0, TRL's): above 0 the reference's log-probs are computed before the steps and read in each, and a full fine-tune keeps a second model.", metavar="X")]  # fmt: skip
VllmOpt = Annotated[Optional[str], typer.Option("--vllm", help="With --rl grpo: use_vllm and vllm_mode: colocate (vLLM in the trainer's process on each GPU, holding --vllm-util of it) or server (trl vllm-serve on GPUs of its own). Without it the policy generates itself (not modelled: the training step and scoring are answered). See docs/rl.md.", metavar="MODE")]  # fmt: skip
VllmUtil = Annotated[Optional[str], typer.Option("--vllm-util", help="With --vllm: vllm_gpu_memory_utilization, the engine's share of each GPU (TRL's default 0.3 colocated; trl vllm-serve's 0.9).", metavar="X")]  # fmt: skip
VllmSleep = Annotated[bool, typer.Option("--vllm-sleep", help="With --vllm colocate: vllm_enable_sleep_mode: the engine sleeps (level 2: weights and KV cache released) while the policy trains.")]  # fmt: skip
VllmMaxLen = Annotated[Optional[str], typer.Option("--vllm-max-len", help="With --vllm: vllm_max_model_length, the engine's max_model_len (default: --seq; TRL's default None leaves vLLM the model's max_position_embeddings).", metavar="N")]  # fmt: skip
GraphMemory = Annotated[Optional[str], typer.Option("--cudagraph-memory", help="With --vllm: the CUDA graph estimate vLLM's log prints ('Estimated CUDA graph memory: X GiB'), subtracted from its budget and held beside its KV cache; not counted without it.", metavar="SIZE")]  # fmt: skip
PrecomputeRef = Annotated[bool, typer.Option("--precompute-ref", help="With --rl dpo: DPOConfig(precompute_ref_log_probs=True): the reference's log-probs are computed before training and come with the batch, so the step runs no reference (and a full fine-tune keeps no second model). See docs/rl.md.")]  # fmt: skip
LigerOpt = Annotated[bool, typer.Option("--liger", help="The Trainer's use_liger_kernel=True (--stack hf): Liger's RMSNorm, RoPE, SwiGLU and the head fused with the cross-entropy, which never holds the logits. See docs/finetune.md.")]  # fmt: skip
OptimizerInBackward = Annotated[bool, typer.Option("--optimizer-in-backward", help="--stack torchtune: optimizer_in_bwd, each parameter's optimizer stepped from its post-accumulate-grad hook (at most one gradient lives).")]  # fmt: skip
Freeze = Annotated[Optional[str], typer.Option("--freeze", help="Full training with parts frozen: embeddings, head, and a number N for the first N blocks (embeddings,4).", metavar="LIST")]  # fmt: skip
PpLayers = Annotated[Optional[str], typer.Option("--pp-layers", help="Layers on the first and last pipeline stages, FIRST,LAST (Megatron-LM's --decoder-first/last-pipeline-num-layers; 0 leaves one to the split). Default: even, or torchtitan's split where pp does not divide the layers.", metavar="F,L")]  # fmt: skip
Reshard = Annotated[Optional[bool], typer.Option("--reshard/--no-reshard", help="FSDP2: free each block's gathered weights after its forward (default: torchtitan's, on without pipeline parallel, off with it).", show_default=False)]  # fmt: skip
NoCache = Annotated[bool, typer.Option("--no-cache", help="--stack hf: the model called with use_cache=False, as a Trainer with gradient checkpointing sets it (by default Transformers keeps a DynamicCache of every layer's keys and values through the forward).")]  # fmt: skip
OffloadActivations = Annotated[bool, typer.Option("--offload-activations", help="The saved activations in pinned host memory: TRL's SFTConfig(activation_offloading=True) on --stack trl:0.25, Transformers' activation_checkpointing_kwargs={'offload': True} on --stack hf with ckpt. See docs/finetune.md.")]  # fmt: skip
RecipeOpt = Annotated[Optional[str], typer.Option("--recipe", help="How 16-bit trains, instead of the stack's: master (fp32 master copy), autocast (fp32 weights), pure (16-bit weights and optimizer state).", metavar="NAME")]  # fmt: skip
ImplOpt = Annotated[Optional[str], typer.Option("--optimizer-impl", help="The optimizer's implementation, instead of the stack's: reference, loop (foreach=False), foreach, fused.", metavar="NAME")]  # fmt: skip
Detail = Annotated[bool, typer.Option("--detail", help="Every section behind the answer, with exact byte counts.")]
CapacityFactor = Annotated[Optional[str], typer.Option("--capacity-factor", help="Mixture of experts: each expert takes at most CF x its balanced tokens, padded to that (Megatron's capacity factor). Default: none, nothing dropped.", metavar="CF")]  # fmt: skip
ExpertImbalance = Annotated[Optional[str], typer.Option("--expert-imbalance", help="Mixture of experts: the busiest GPU's experts get X times their balanced tokens (default 1: balanced).", metavar="X")]  # fmt: skip
ExactBytes = Annotated[bool, typer.Option("--bytes", help="Exact byte counts under each value (JSON and CSV always carry them).")]  # fmt: skip
FromFile = Annotated[Optional[str], typer.Option("--from", help="A training recipe's file: TRL's SFTConfig or Transformers' TrainingArguments (JSON or YAML), an axolotl config or a torchtune recipe config; KIND:FILE (trainer, axolotl, torchtune) where its keys leave the kind open. Its keys set the options; those typed win. See docs/finetune.md.", metavar="FILE")]  # fmt: skip
