"""Serving a trained model: what one GPU of an inference server holds and how fast it decodes.

  job       the question (ServeJob): the model, the GPU, the context, the weights' and KV cache's formats,
            vLLM's settings (gpu_memory_utilization, block size, max_num_batched_tokens, max_num_seqs) and
            tensor / pipeline / expert parallel serving
  weights   the weights at their serving precision: bf16, fp8 with per-tensor scales, int8 and int4
            weight-only (GPTQ, AWQ) with their group scales and zeros, split by TP, PP and EP
  kv        the KV cache per token and per request: GQA, MLA's latent and rope parts, sliding-window layers
            that keep only the window, fp8; as vLLM pages it and as Transformers' caches hold it
  budget    vLLM's reservations: total x gpu_memory_utilization less weights, the profile run's activation
            peak at max_num_batched_tokens and non-torch memory; the blocks, requests and context that fit
  releases  vLLM's releases as they differ in the budget (--vllm-version), each read from its wheel
  profile   the profile run's activation peak: the forward and the sampler, per release and model runner
  runners   V1's and V2's model runners: which one a release takes, and the tensors each keeps
  sglang    SGLang's KV pool on the same GPU (--sglang): mem_fraction_static and its heuristic
  timing    prefill (compute-bound) and decode (memory-bound) on the roofline and training's calibration
  answer    ServeJob in, ServeAnswer out, and what to change to fit

May import: memcalc.model, memcalc.time (the calibration), memcalc.errors, memcalc.terms, memcalc.records.
"""
