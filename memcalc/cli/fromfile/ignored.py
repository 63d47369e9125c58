"""The keys of each kind of recipe file that do not change the memory or the step memcalc answers for:
hyper-parameters, schedules, logging, saving, evaluation, data loading and its paths, hub uploads. They are
reported as ignored; a key in none of these lists and read by no reader is reported as not read, so that a key
memcalc does not know is never passed off as harmless.

Read from transformers src/transformers/training_args.py @ fd798335c275 (Transformers 5's TrainingArguments)
with the fields Transformers 4 had and 5 dropped, huggingface/trl trl/trainer/sft_config.py and model_config.py
(v0.14.0 to v0.25.0) and its ScriptArguments, axolotl src/axolotl/utils/schemas/*.py @ 067b021c8b87, and
torchtune recipes/configs @ bd2a0fc7c314. A name ending in `.*` covers every key under that section.
"""

from __future__ import annotations

TRAINER = frozenset("""
output_dir overwrite_output_dir do_train do_eval do_predict eval_strategy evaluation_strategy prediction_loss_only
per_device_eval_batch_size per_gpu_eval_batch_size eval_accumulation_steps eval_delay eval_steps eval_on_start
eval_do_concat_batches eval_use_gather_object batch_eval_metrics include_for_metrics include_inputs_for_metrics
bf16_full_eval fp16_full_eval learning_rate weight_decay adam_beta1 adam_beta2 adam_epsilon
num_train_epochs max_steps lr_scheduler_type lr_scheduler_kwargs warmup_ratio warmup_steps log_level
log_level_replica log_on_each_node logging_dir logging_strategy logging_first_step logging_steps
logging_nan_inf_filter save_strategy save_steps save_total_limit save_safetensors save_on_each_node save_only_model
restore_callback_states_from_checkpoint enable_jit_checkpoint seed data_seed full_determinism jit_mode_eval use_ipex
fp16_opt_level half_precision_backend fp16_backend tf32 local_rank ddp_backend tpu_num_cores tpu_metrics_debug
debug dataloader_drop_last dataloader_num_workers dataloader_prefetch_factor dataloader_pin_memory
dataloader_persistent_workers dataloader_in_order dataloader_multiprocessing_context past_index run_name
disable_tqdm remove_unused_columns label_names load_best_model_at_end metric_for_best_model greater_is_better
ignore_data_skip accelerator_config ddp_find_unused_parameters ddp_bucket_cap_mb ddp_broadcast_buffers
ddp_static_graph ddp_timeout skip_memory_metrics use_legacy_prediction_loop push_to_hub resume_from_checkpoint
hub_model_id hub_strategy hub_token hub_private_repo hub_always_push hub_revision push_to_hub_model_id
push_to_hub_organization push_to_hub_token mp_parameters torchdynamo ray_scope include_tokens_per_second
include_num_input_tokens_seen report_to project trackio_space_id trackio_bucket_id trackio_static_space_id
optim_args train_sampling_strategy length_column_name group_by_length prediction_loss_only
average_tokens_across_devices torch_empty_cache_steps torch_compile_backend torch_compile_mode dispatch_batches
split_batches use_mps_device no_cuda sortish_sampler predict_with_generate generation_max_length
generation_num_beams generation_config save_steps
dataset_text_field dataset_kwargs dataset_num_proc dataset_batch_size num_of_sequences chars_per_token eval_packing
packing_strategy pad_to_multiple_of eos_token pad_token chat_template_path completion_only_loss
assistant_only_loss shuffle_dataset truncation_mode dataset_name dataset_config dataset_train_split
dataset_test_split dataset_streaming ignore_bias_buffers model_revision trust_remote_code env config
chat_template dataset_mixture dataset_mixer dataset_splits dataset_configs preprocessing_num_workers
preprocessing_log_samples truncation_side auto_insert_empty_system_msg text_column hub_model_revision
model_init_kwargs.device_map model_init_kwargs.trust_remote_code model_init_kwargs.revision
model_init_kwargs.low_cpu_mem_usage model_init_kwargs.quantization_config.llm_int8_threshold
model_init_kwargs.quantization_config.llm_int8_has_fp16_weight
""".split())  # fmt: skip

AXOLOTL = frozenset("""
model_type tokenizer_type tokenizer_config tokenizer_use_fast tokenizer_legacy tokenizer_use_mistral_common
processor_type trust_remote_code is_llama_derived_model is_mistral_derived_model is_qwen_derived_model
is_falcon_derived_model output_dir hub_model_id hub_strategy hub_revision save_safetensors bos_token eos_token
pad_token unk_token additional_special_tokens special_tokens tokens added_tokens_overrides chat_template
chat_template_jinja chat_template_kwargs eot_tokens default_system_message datasets test_datasets val_set_size
dataset_prepared_path dataset_processes dataset_num_proc dataset_exact_deduplication dataset_keep_in_memory
shuffle_merged_datasets shuffle_before_merging_datasets push_dataset_to_hub hf_use_auth_token dataloader_pin_memory
dataloader_num_workers dataloader_prefetch_factor dataloader_drop_last train_on_inputs group_by_length
learning_rate embedding_lr embedding_lr_scale weight_decay lr_scheduler lr_scheduler_kwargs lr_quadratic_warmup
cosine_min_lr_ratio cosine_constant_lr_ratio lr_div_factor adam_epsilon adam_epsilon2 adam_beta1 adam_beta2
adam_beta3 num_epochs max_steps warmup_steps warmup_ratio eval_steps evals_per_epoch eval_strategy
save_steps saves_per_epoch save_strategy save_total_limit save_first_step logging_steps early_stopping_patience
load_best_model_at_end save_only_model use_tensorboard profiler_steps profiler_steps_start
include_tokens_per_second include_tkps wandb_project wandb_entity wandb_watch wandb_name wandb_run_id
wandb_log_model mlflow_tracking_uri mlflow_experiment_name comet_api_key comet_workspace comet_project_name
resume_from_checkpoint auto_resume_from_checkpoints local_rank seed strict debug ddp_timeout ddp_bucket_cap_mb
ddp_broadcast_buffers ddp_find_unused_parameters eval_sample_packing eval_sequence_len eval_batch_size
eval_table_size eval_max_new_tokens do_causal_lm_eval eval_causal_lm_metrics do_bench_eval bench_dataset
bench_split metric_for_best_model greater_is_better loss_watchdog_threshold loss_watchdog_patience tf32 pad_to_sequence_len
lora_alpha lora_model_dir lora_fan_in_fan_out peft_use_rslora lora_on_cpu merge_lora pretraining_dataset
sample_packing_group_size sample_packing_bin_size sample_packing_sequentially curriculum_sampling
multipack_real_batches min_sample_len max_prompt_len excess_length_strategy model_config_type gc_steps
torch_compile_backend torch_compile_mode num_epochs low_cpu_mem_usage device_map max_memory gpu_memory_limit
""".split())  # fmt: skip

TORCHTUNE = frozenset("""
output_dir tokenizer.* checkpointer.* resume_from_checkpoint save_adapter_weights_only dataset.* dataset_val.*
dataset_val batch_size_val run_val_every_n_steps seed shuffle lr_scheduler.* epochs max_steps_per_epoch
metric_logger.* log_every_n_steps log_peak_memory_stats log_level device profiler.* low_cpu_ram clip_grad_norm
optimizer.* save_last_epoch_only loss.* enable_kd kd_ratio kd_loss.* teacher_model.* seed
""".split())  # fmt: skip

IRRELEVANT = {"trainer": TRAINER, "axolotl": AXOLOTL, "torchtune": TORCHTUNE}


def irrelevant(kind: str, key: str) -> bool:
    """Whether the dotted key is one that does not change memory in this kind of file."""
    names = IRRELEVANT[kind]
    if key in names or key + ".*" in names:
        return True
    parts = key.split(".")
    return any(".".join(parts[:i]) + ".*" in names for i in range(1, len(parts)))
