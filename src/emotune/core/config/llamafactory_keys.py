"""The LLaMA-Factory keys emotune reads: each translated key's default and the dataclass that defines it, the keys it
refuses (with the value that changes nothing) and those it ignores (with why). emotune.core.config.llamafactory
translates them; where the defaults come from is said there."""

from __future__ import annotations

from typing import Any

FINETUNING = "LLaMA-Factory FinetuningArguments"
DATA = "LLaMA-Factory DataArguments"
MODEL = "LLaMA-Factory ModelArguments"
TRAINER = "transformers Seq2SeqTrainingArguments"

# The value each translated key takes when a file leaves it out, and the dataclass that defines it.
# (`stage`, whose default names emotune's task too, is added by emotune.core.config.llamafactory)
KEY_DEFAULTS: dict[str, tuple[Any, str]] = {
    "model_name_or_path": (None, MODEL),
    "model_revision": ("main", MODEL),
    "disable_gradient_checkpointing": (False, MODEL),  # LLaMA-Factory turns checkpointing on unless this is true
    "quantization_bit": (None, MODEL),  # QuantizationArguments (model_args.py): None = not quantized
    "quantization_method": ("bnb", MODEL),
    "quantization_type": ("nf4", MODEL),
    "double_quantization": (True, MODEL),
    "finetuning_type": ("lora", FINETUNING),
    "freeze_trainable_layers": (2, FINETUNING),
    "freeze_trainable_modules": ("all", FINETUNING),
    "freeze_extra_modules": (None, FINETUNING),
    "lora_rank": (8, FINETUNING),
    "lora_alpha": (None, FINETUNING),  # None = lora_rank * 2 (FinetuningArguments.__post_init__)
    "lora_dropout": (0.0, FINETUNING),
    "lora_target": ("all", FINETUNING),  # `all` = every linear layer but the output layer
    "additional_target": (None, FINETUNING),
    "use_dora": (False, FINETUNING),
    "use_rslora": (False, FINETUNING),
    "plot_loss": (False, FINETUNING),
    "loraplus_lr_ratio": (None, FINETUNING),
    "pissa_init": (False, FINETUNING),
    "adapter_name_or_path": (None, MODEL),
    "pissa_iter": (16, FINETUNING),
    "pissa_convert": (False, FINETUNING),
    "loraplus_lr_embedding": (1e-6, FINETUNING),
    "dataset": (None, DATA),
    "eval_dataset": (None, DATA),
    "dataset_dir": ("data", DATA),
    "template": (None, DATA),  # None = the tokenizer's own chat template (`empty` when it has none)
    "cutoff_len": (2048, DATA),
    "max_samples": (None, DATA),
    "val_size": (0.0, DATA),
    "mask_history": (False, DATA),
    "default_system": (None, DATA),
    "do_train": (False, TRAINER),
    "output_dir": (None, TRAINER),
    "overwrite_output_dir": (False, "LLaMA-Factory TrainingArguments"),
    "per_device_train_batch_size": (8, TRAINER),
    "per_device_eval_batch_size": (8, TRAINER),
    "gradient_accumulation_steps": (1, TRAINER),
    "learning_rate": (5e-5, TRAINER),
    "num_train_epochs": (3.0, TRAINER),
    "max_steps": (-1, TRAINER),
    "lr_scheduler_type": ("linear", TRAINER),
    "warmup_ratio": (0.0, TRAINER),
    "warmup_steps": (0, TRAINER),
    "weight_decay": (0.0, TRAINER),
    "max_grad_norm": (1.0, TRAINER),
    "adam_beta1": (0.9, TRAINER),
    "adam_beta2": (0.999, TRAINER),
    "adam_epsilon": (1e-8, TRAINER),
    "group_by_length": (False, TRAINER),
    "optim": ("adamw_torch_fused", TRAINER),  # the same AdamW as adamw_torch, in one fused kernel
    "bf16": (False, TRAINER),
    "fp16": (False, TRAINER),
    "gradient_checkpointing": (False, TRAINER),
    "logging_steps": (500, TRAINER),
    "save_steps": (500, TRAINER),
    "save_total_limit": (None, TRAINER),  # None = every checkpoint kept; emotune then keeps its own default
    "eval_steps": (None, TRAINER),  # None = logging_steps
    "eval_strategy": ("no", TRAINER),
    "evaluation_strategy": (None, "transformers before 4.41"),  # eval_strategy's name until 4.41 renamed it
    "report_to": ("none", TRAINER),  # "none" since transformers 5 ("all" before)
    "seed": (42, TRAINER),
}

# Keys that would make LLaMA-Factory train differently from anything emotune does, and their harmless values.
REFUSED: dict[str, tuple[Any, str]] = {
    "train_on_prompt": (False, "emotune's loss is on the assistant turns only; remove train_on_prompt"),
    "packing": (None, "emotune does not pack rows together; remove packing"),
    "neat_packing": (False, "emotune does not pack rows together; remove neat_packing"),
    "create_new_adapter": (False, "emotune trains on from the adapter itself; to train a new adapter over a merged "
                                  "one, merge it first (`emotune export --merge`) and point model_name_or_path at it"),
    "use_galore": (False, "GaLore is not a LoRA method emotune has; use finetuning_type: lora"),
    "use_apollo": (False, "APOLLO is not a LoRA method emotune has; use finetuning_type: lora"),
    "use_badam": (False, "BAdam is not a LoRA method emotune has; use finetuning_type: lora"),
    "use_llama_pro": (False, "LLaMA Pro block expansion is not something emotune does; remove use_llama_pro"),
    "streaming": (False, "emotune reads the whole dataset; remove streaming"),
    "mix_strategy": ("concat", "emotune mixes datasets by concatenation only; remove mix_strategy"),
    "neftune_noise_alpha": (None, "emotune adds no noise to the embeddings while training (NEFTune); remove it"),
    "rope_scaling": (None, "emotune trains the model with its own position encoding; remove rope_scaling"),
    "train_from_scratch": (False, "emotune fine-tunes the model's trained weights; remove train_from_scratch"),
    "resize_vocab": (False, "emotune keeps the model's vocabulary; remove resize_vocab"),
    "label_smoothing_factor": (0.0, "emotune's loss is plain cross-entropy; remove label_smoothing_factor"),
    "use_adam_mini": (False, "Adam-mini is not an optimizer emotune has; use optim"),
    "lr_scheduler_kwargs": (None, "emotune's schedules take no extra arguments; remove lr_scheduler_kwargs"),
    "use_dft_loss": (False, "DFT reweights each token's loss by its probability; emotune's loss is plain "
                            "cross-entropy; remove use_dft_loss"),
    "use_asft_loss": (False, "ASFT adds a KL term to the loss; emotune's loss is plain cross-entropy; remove "
                             "use_asft_loss"),
    "use_eaft_loss": (False, "EAFT reweights the loss by the model's entropy; emotune's loss is plain cross-entropy; "
                             "remove use_eaft_loss"),
    "use_muon": (False, "Muon is not an optimizer emotune has; use optim"),
    "mixture_of_depths": (None, "emotune trains the model's own layers, not a mixture-of-depths conversion; remove "
                                "mixture_of_depths"),
    "pure_bf16": (False, "emotune keeps trainable weights in float32 under bf16 autocast; use bf16: true"),
    "freeze_language_model": (False, "emotune trains the language model (the text side of a multimodal model); "
                                     "remove freeze_language_model"),
    "optim_args": (None, "emotune's optimizers take no extra arguments; remove optim_args"),
    "push_to_hub": (False, "emotune uploads a finished run with `emotune push RUN_FOLDER` (adapter and model card); "
                           "remove push_to_hub"),
    "dataset_name": (None, "it is a TRL script's key, not LLaMA-Factory's, which names dataset_info.json entries in "
                           "`dataset`; for a hub dataset write an emotune config with task: sft and "
                           "data.source: hf:OWNER/NAME"),
}

PERFORMANCE = "a speed or memory setting of LLaMA-Factory's; it does not change what is learned"
IGNORED: dict[str, str] = {
    **dict.fromkeys(("preprocessing_num_workers", "preprocessing_batch_size", "dataloader_num_workers",
                     "overwrite_cache", "tokenized_path", "data_shared_file_system"),
                    "emotune prepares the data once, in one process, and keeps it in the run folder"),
    **dict.fromkeys(("flash_attn", "enable_liger_kernel", "use_v1_kernels", "use_kt", "kt_cpu_activation", "kt_config",
                     "kt_weight_path", "kt_non_expert_weight_path", "fp8", "fp8_backend",
                     "fp8_enable_fsdp_float8_all_gather", "torch_compile", "tf32", "gradient_checkpointing_kwargs",
                     "auto_find_batch_size", "dataloader_pin_memory", "dataloader_persistent_workers",
                     "use_unsloth", "use_unsloth_gc", "use_reentrant_gc",
                     "upcast_layernorm", "shift_attn", "ddp_timeout", "include_effective_tokens_per_second"),
                    PERFORMANCE),
    **dict.fromkeys(("deepspeed", "fsdp", "fsdp_config", "ddp_find_unused_parameters", "ray_num_workers"),
                    "launch several processes with torchrun or accelerate launch (train.fsdp=true to shard)"),
    **dict.fromkeys(("do_eval", "do_predict", "predict_with_generate", "compute_accuracy"),
                    "emotune always measures the model before and after training on the test split"),
    **dict.fromkeys(("max_new_tokens", "temperature", "top_p", "top_k", "do_sample", "num_beams",
                     "repetition_penalty", "length_penalty", "generation_max_length", "generation_num_beams",
                     "infer_backend", "infer_dtype"),
                    "generation settings: emotune's evaluation decodes greedily, up to eval.max_new_tokens"),
    **dict.fromkeys(("load_best_model_at_end", "metric_for_best_model", "greater_is_better"),
                    "emotune always keeps the adapter with the lowest validation loss"),
    **dict.fromkeys(("save_strategy", "logging_strategy"), "emotune saves and logs by steps"),
    **dict.fromkeys(("run_name", "logging_dir", "project"), "the run is named by output_dir"),
    **dict.fromkeys(("image_max_pixels", "image_min_pixels", "video_max_pixels", "video_min_pixels", "video_fps",
                     "video_maxlen", "audio_sampling_rate", "freeze_vision_tower", "freeze_multi_modal_projector"),
                    "a setting for images, video or audio; emotune trains on text, and never the vision tower"),
    **dict.fromkeys(("pref_beta", "pref_ftx", "pref_loss", "simpo_gamma", "kto_chosen_weight", "kto_rejected_weight"),
                    "a preference-training (dpo, kto) setting; stage sft does not read it"),
    "trust_remote_code": "emotune loads models with transformers' own classes and never runs code from the hub",
    "cache_dir": "hub models go to Hugging Face's shared cache, or model.cache_dir/hub when that is set",
    "save_only_model": "emotune checkpoints always hold the optimizer state, so a run can resume",
    "resume_from_checkpoint": "emotune resumes from the run folder's newest checkpoint by itself",
    "enable_thinking": "emotune renders turns with the model's chat template as it is",
}

SCHEDULES = ("linear", "cosine", "constant", "constant_with_warmup")
OPTIMIZERS = ("adamw_torch", "adamw_torch_fused", "sgd", "adafactor", "adamw_8bit", "paged_adamw_8bit",
              "paged_adamw_32bit")
# transformers' other names for the same optimizers (OptimizerNames)
OPTIMIZER_ALIASES = {"adamw_bnb_8bit": "adamw_8bit", "adamw_torch_8bit": "adamw_8bit"}
TRACKERS = ("tensorboard", "mlflow", "wandb")
