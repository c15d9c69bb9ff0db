"""The Axolotl keys emotune reads: each translated key's default and the schema that defines it, the keys it refuses
(with the value that changes nothing) and those it ignores (with why). emotune.core.config.axolotl translates them;
where the defaults come from is said there."""

from __future__ import annotations

from typing import Any

CONFIG = "Axolotl AxolotlInputConfig (schemas/config.py)"
PEFT = "Axolotl LoraConfig (schemas/peft.py)"
HYPER = "Axolotl HyperparametersConfig (schemas/training.py)"
OUTPUT = "Axolotl ModelOutputConfig (schemas/model.py)"
TRAINER = "transformers TrainingArguments (Axolotl passes no value)"

# The value each translated key takes when a file leaves it out, and the schema that defines it.
KEY_DEFAULTS: dict[str, tuple[Any, str]] = {
    "base_model": (None, CONFIG),
    "base_model_config": (None, CONFIG),
    "tokenizer_config": (None, CONFIG),
    "revision_of_model": (None, CONFIG),
    "datasets": (None, CONFIG),
    "val_set_size": (0.0, CONFIG),
    "sequence_len": (512, CONFIG),
    "excess_length_strategy": (None, CONFIG),  # None = drop the longer rows
    "adapter": (None, PEFT),  # None = train every parameter of the model
    "load_in_4bit": (False, PEFT),
    "load_in_8bit": (False, PEFT),
    "lora_model_dir": (None, PEFT),
    "lora_r": (None, PEFT),  # no default: PEFT's LoraConfig gets None and fails
    "lora_alpha": (None, PEFT),
    "lora_dropout": (0.0, PEFT),
    "lora_target_modules": (None, PEFT),
    "lora_target_linear": (None, PEFT),
    "lora_modules_to_save": (None, PEFT),
    "lora_target_parameters": (None, PEFT),
    "bnb_config_kwargs": (None, CONFIG),
    "quantize_moe_experts": (False, PEFT),
    "unfrozen_parameters": (None, CONFIG),
    "eot_tokens": (None, CONFIG),
    "peft_layers_to_transform": (None, PEFT),
    "peft_use_rslora": (None, PEFT),
    "peft_use_dora": (None, PEFT),
    "peft": (None, PEFT),  # PeftConfig: loftq_config (LoftQConfig, loftq_bits 4) for LoftQ initialisation
    "loraplus_lr_ratio": (None, PEFT),
    "loraplus_lr_embedding": (1e-6, PEFT),
    "micro_batch_size": (1, HYPER),
    "gradient_accumulation_steps": (1, HYPER),
    "num_epochs": (1.0, HYPER),
    "max_steps": (None, CONFIG),
    "learning_rate": (None, HYPER),  # required
    "lr_scheduler": ("cosine", HYPER),
    "warmup_steps": (None, CONFIG),  # neither warmup key: 3% of the steps, at most 100 (builders/base.py)
    "warmup_ratio": (None, CONFIG),
    "optimizer": ("adamw_torch_fused", HYPER),
    "weight_decay": (0.0, HYPER),
    "max_grad_norm": (None, HYPER),  # None = transformers' 1.0
    "adam_beta1": (0.9, TRAINER),
    "adam_beta2": (0.999, TRAINER),
    "adam_epsilon": (1e-8, TRAINER),
    "group_by_length": (None, HYPER),
    "train_on_inputs": (False, HYPER),
    "bf16": ("auto", CONFIG),
    "fp16": (None, CONFIG),
    "gradient_checkpointing": (False, CONFIG),
    "chat_template": (None, CONFIG),  # None = tokenizer_default for chat_template datasets
    "chat_template_jinja": (None, CONFIG),
    "default_system_message": (None, CONFIG),
    "special_tokens": (None, CONFIG),
    "dataset_exact_deduplication": (None, CONFIG),
    "plugins": (None, CONFIG),
    "seed": (None, CONFIG),  # None = transformers' 42
    "output_dir": ("./model-out", OUTPUT),
    "logging_steps": (None, CONFIG),  # None = 0.5% of the steps, 1 to 10
    "eval_steps": (None, CONFIG),  # None = once an epoch
    "save_steps": (None, CONFIG),  # None = once an epoch
    "save_total_limit": (None, CONFIG),
    "early_stopping_patience": (None, CONFIG),
}

# The true/false keys whose default is None (unset), so their default's type does not say it
FLAGS = ("lora_target_linear", "peft_use_rslora", "peft_use_dora", "fp16", "group_by_length",
         "dataset_exact_deduplication")

PACKING = "emotune trains on one row at a time (padded batches) and does not pack rows together"
# Keys that would make Axolotl train differently from anything emotune does, and their harmless values.
REFUSED: dict[str, tuple[Any, str]] = {
    "sample_packing": (False, f"{PACKING}; remove sample_packing or set it false"),
    "rl": (None, "emotune runs supervised fine-tuning only (Axolotl's rl: dpo, ipo, kto, orpo, simpo, grpo train on "
                 "preferences or rewards); remove rl"),
    "reward_model": (False, "emotune trains language models on answers, not reward models; remove reward_model"),
    "process_reward_model": (False, "emotune trains language models on answers, not reward models"),
    "pretraining_dataset": (None, "streamed pretraining text is not something emotune trains on; give datasets of "
                                  "instructions or conversations"),
    "test_datasets": (None, "emotune takes its validation rows from the one data source: put the files in one folder "
                            "as train.jsonl and validation.jsonl and give that folder as the dataset's path, or use "
                            "val_set_size"),
    "deepspeed": (None, "emotune does not run DeepSpeed; for several GPUs launch `torchrun -m emotune train` "
                        "(train.fsdp=true to shard the model); remove deepspeed"),
    "fsdp": (None, "emotune shards with its own FSDP2: launch with torchrun and set train.fsdp=true; remove fsdp"),
    "fsdp_config": (None, "emotune shards with its own FSDP2: launch with torchrun and set train.fsdp=true; remove "
                          "fsdp_config"),
    "tokens": (None, "emotune keeps the model's vocabulary; remove tokens"),
    "neftune_noise_alpha": (None, "emotune adds no noise to the embeddings while training (NEFTune); remove it"),
    "noisy_embedding_alpha": (None, "emotune adds no noise to the embeddings while training (NEFTune); remove it"),
    "lr_scheduler_kwargs": (None, "emotune's schedules take no extra arguments; remove lr_scheduler_kwargs"),
    "cosine_min_lr_ratio": (None, "emotune's cosine schedule decays to 0; remove cosine_min_lr_ratio"),
    "cosine_constant_lr_ratio": (None, "emotune's cosine schedule has no constant phase; remove it"),
    "lr_quadratic_warmup": (False, "emotune warms up linearly; remove lr_quadratic_warmup"),
    "optim_args": (None, "emotune's optimizers take no extra arguments; remove optim_args"),
    "embedding_lr": (None, "emotune trains every parameter at one learning rate; remove embedding_lr"),
    "embedding_lr_scale": (None, "emotune trains every parameter at one learning rate; remove embedding_lr_scale"),
    "relora_steps": (None, "ReLoRA (merging and restarting the adapter) is not something emotune does"),
    "lora_fan_in_fan_out": (False, "emotune's adapters are on nn.Linear layers; remove lora_fan_in_fan_out"),
    "lora_rank_pattern": (None, "emotune gives every adapter the same rank; remove lora_rank_pattern"),
    "lora_alpha_pattern": (None, "emotune gives every adapter the same alpha; remove lora_alpha_pattern"),
    "peft_layers_pattern": (None, "emotune finds the decoder layers itself; remove peft_layers_pattern"),
    "peft_init_lora_weights": (None, "emotune starts LoRA as PEFT does (lora.init for PiSSA, OLoRA, LoftQ)"),
    "bfloat16": (False, "emotune keeps trainable weights in float32 under bf16 autocast; use bf16: true"),
    "float16": (False, "emotune keeps trainable weights in float32 under fp16 autocast; use fp16: true"),
    "fp8": (False, "emotune trains in bf16, fp16 or fp32, not fp8; remove fp8"),
    "gptq": (False, "emotune quantizes the base with bitsandbytes only (load_in_4bit, load_in_8bit)"),
    "rope_scaling": (None, "emotune trains the model with its own position encoding; remove rope_scaling"),
    "curriculum_sampling": (False, "emotune shuffles the training rows; remove curriculum_sampling"),
    "chat_template_kwargs": (None, "emotune renders turns with the chat template's own defaults"),
    "shuffle_before_merging_datasets": (False, "emotune reads one dataset; remove it"),
    **dict.fromkeys(("model_config", "overrides_of_model_config"), (
        None, "it overrides the model's own config (output_router_logits: true, for one, adds the router's "
              "load-balancing loss to what is trained); emotune loads the model's config as it is; remove it")),
    "use_onebitllms": (False, "1.58-bit (BitNet) training is not something emotune does; remove use_onebitllms"),
    "processor_type": (None, "it loads an image or audio processor for a multimodal model; emotune trains on text "
                             "turns only: remove processor_type and give text rows"),
    "resize_token_embeddings_to_32x": (False, "emotune keeps the model's embedding table as it is (Axolotl grows it "
                                              "to a multiple of 32 rows, adding output logits); remove it"),
}

PERFORMANCE = "a speed or memory setting of Axolotl's; it does not change what is learned"
TRACKING = ("experiment tracking: it changes nothing learned; emotune reports to the trackers named in "
            "train.report_to (e.g. train.report_to=wandb)")
IGNORED: dict[str, str] = {
    **dict.fromkeys(("wandb_project", "wandb_entity", "wandb_watch", "wandb_name", "wandb_run_id", "wandb_log_model",
                     "wandb_mode", "use_wandb", "mlflow_tracking_uri", "mlflow_experiment_name", "mlflow_run_name",
                     "use_mlflow", "use_tensorboard", "use_comet", "comet_project_name", "comet_mode",
                     "include_tokens_per_second", "include_tkps", "profiler_steps"), TRACKING),
    # the keys of Axolotl's SwanLab plugin (integrations/swanlab/args.py); `swanlab_project` read as a near miss of
    # wandb_project and was refused
    **dict.fromkeys(("use_swanlab", "swanlab_project", "swanlab_experiment_name", "swanlab_description", "swanlab_mode",
                     "swanlab_workspace", "swanlab_api_key", "swanlab_log_model", "swanlab_web_host",
                     "swanlab_api_host", "swanlab_lark_webhook_url", "swanlab_lark_secret", "swanlab_log_completions",
                     "swanlab_completion_log_interval", "swanlab_completion_max_buffer"), TRACKING),
    **dict.fromkeys(("flash_attention", "sdp_attention", "xformers_attention", "flex_attention", "s2_attention",
                     "eager_attention", "flash_attn_cross_entropy", "flash_attn_rms_norm", "flash_attn_fuse_qkv",
                     "flash_attn_fuse_mlp", "liger_rope", "liger_rms_norm", "liger_glu_activation",
                     "liger_layer_norm", "liger_fused_linear_cross_entropy", "liger_cross_entropy",
                     "cut_cross_entropy", "unsloth_cross_entropy_loss", "unsloth_lora_mlp", "unsloth_lora_qkv",
                     "unsloth_lora_o", "unsloth_rms_norm", "unsloth_rope", "tf32", "torch_compile",
                     "torch_compile_backend", "torch_compile_mode", "pad_to_sequence_len", "eval_sample_packing",
                     "sample_packing_eff_est", "gradient_checkpointing_kwargs", "activation_offloading",
                     "auto_find_batch_size", "dataloader_num_workers", "dataloader_pin_memory",
                     "dataloader_prefetch_factor", "dataloader_drop_last", "dataset_processes", "dataset_num_proc",
                     "dataset_prepared_path", "dataset_keep_in_memory", "low_cpu_mem_usage", "gc_steps",
                     "torch_empty_cache_steps", "eval_batch_size", "gpu_memory_limit", "max_memory", "device_map",
                     "ddp_timeout", "ddp_bucket_cap_mb", "ddp_broadcast_buffers", "ddp_find_unused_parameters",
                     "sequence_parallel_degree", "context_parallel_size", "tensor_parallel_size", "dp_shard_size",
                     "tokenizer_use_fast", "tokenizer_legacy", "model_config_type", "model_type", "tokenizer_type",
                     "is_llama_derived_model", "is_mistral_derived_model", "is_qwen_derived_model",
                     "is_falcon_derived_model", "local_rank", "strict", "debug", "trust_remote_code", "use_kernels",
                     "use_scattermoe", "experts_implementation", "liger_rms_norm_gated", "lora_mlp_kernel",
                     "lora_qkv_kernel", "lora_o_kernel", "fused_attn_kernel", "attn_implementation",
                     "gemma4_hybrid_attn_impl", "use_sonicmoe", "accelerator_config",
                     "experimental_skip_move_to_device", "fsdp_version", "dp_replicate_size", "remove_unused_columns",
                     "skip_prepare_dataset"), PERFORMANCE),
    **dict.fromkeys(("sample_packing_sequentially", "sample_packing_bin_size", "sample_packing_group_size",
                     "sample_packing_mp_start_method"),
                    "a sample-packing setting: it acts only with sample_packing: true, which emotune refuses"),
    **dict.fromkeys(("rl_beta", "dpo_beta", "orpo_alpha", "simpo_gamma", "cpo_alpha", "kto_desirable_weight",
                     "kto_undesirable_weight", "num_labels", "center_rewards_coefficient"),
                    "a preference (rl) or reward-model setting: it acts only with rl or reward_model, which emotune "
                    "refuses"),
    **dict.fromkeys(("evals_per_epoch", "saves_per_epoch", "eval_strategy", "save_strategy", "save_first_step",
                     "load_best_model_at_end", "save_safetensors", "save_only_model"),
                    "emotune validates every train.eval_steps and checkpoints every train.save_steps optimizer steps "
                    "(set them in steps) and keeps the adapter with the lowest validation loss"),
    **dict.fromkeys(("eval_table_size", "eval_max_new_tokens", "do_causal_lm_eval", "eval_causal_lm_metrics",
                     "eval_sequence_len", "do_bench_eval", "bench_dataset"),
                    "emotune measures the model before and after training on the test split, greedily up to "
                    "eval.max_new_tokens"),
    **dict.fromkeys(("hub_model_id", "hub_strategy", "hub_revision", "push_dataset_to_hub", "hf_use_auth_token"),
                    "emotune uploads a finished run with `emotune push RUN_FOLDER`"),
    **dict.fromkeys(("resume_from_checkpoint", "auto_resume_from_checkpoints"),
                    "emotune resumes from the run folder's newest checkpoint by itself"),
    **dict.fromkeys(("loss_watchdog_threshold", "loss_watchdog_patience"),
                    "emotune stops after train.max_nonfinite_steps steps with a NaN or infinite loss"),
    "shuffle_merged_datasets": "emotune reads one dataset and shuffles its training rows",
    "merge_lora": "emotune merges a finished run with `emotune export RUN_FOLDER --merge`",
}

# Axolotl's own plugins that change only speed or memory (the same loss, computed in fewer kernels)
KERNEL_PLUGINS = ("liger", "cut_cross_entropy", "integrations.kernels")
# Axolotl's plugins that only report the run to a tracker (its keys are in IGNORED)
TRACKER_PLUGINS = ("integrations.swanlab",)
