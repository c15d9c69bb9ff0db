"""The training stage: LoRA on the language model with TRL's SFTTrainer, loss on the completion only.

TRL and PEFT are used as libraries: we build their configs from ours, check what they built (LoRA
must hit some module), run, and save the adapter with everything needed to reuse it.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

from datasets import Dataset
from peft import LoraConfig as PeftLoraConfig
from transformers import PreTrainedModel, PreTrainedTokenizerBase
from transformers.trainer_utils import get_last_checkpoint
from trl import SFTConfig, SFTTrainer

from emotune.config import RunConfig
from emotune.data import LabeledData, system_prompt, to_prompt_completion
from emotune.device import Precision
from emotune.errors import UserError

ADAPTER_META = "emotune.json"


def lora_config(cfg: RunConfig) -> PeftLoraConfig:
    return PeftLoraConfig(
        r=cfg.lora.r,
        lora_alpha=cfg.lora.alpha,
        lora_dropout=cfg.lora.dropout,
        target_modules=cfg.lora.target_modules,
        task_type="CAUSAL_LM",
    )


def sft_config(cfg: RunConfig, precision: Precision, output_dir: Path, has_validation: bool, use_cpu: bool) -> SFTConfig:
    t = cfg.train
    return SFTConfig(
        output_dir=str(output_dir),
        max_steps=t.max_steps,
        num_train_epochs=t.num_train_epochs,
        per_device_train_batch_size=t.batch_size,
        per_device_eval_batch_size=cfg.train.batch_size if cfg.eval.batch_size == "auto" else cfg.eval.batch_size,
        gradient_accumulation_steps=t.gradient_accumulation_steps,
        learning_rate=t.learning_rate,
        lr_scheduler_type=t.lr_scheduler_type,
        warmup_steps=t.warmup_ratio,  # transformers 5: a float below 1 is a share of the steps
        weight_decay=t.weight_decay,
        optim=t.optim,
        max_length=t.max_length,
        completion_only_loss=True,
        gradient_checkpointing=t.gradient_checkpointing,
        bf16=precision.name == "bf16",
        fp16=precision.name == "fp16",
        eval_strategy="steps" if has_validation else "no",
        eval_steps=t.eval_steps,
        save_strategy="steps",
        save_steps=t.save_steps,
        save_total_limit=2,
        logging_steps=t.logging_steps,
        report_to="none",
        seed=cfg.seed,
        data_seed=cfg.seed,
        use_cpu=use_cpu,
        dataloader_num_workers=0,
        disable_tqdm=False,
    )


def train(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, data: LabeledData, cfg: RunConfig,
          precision: Precision, run_dir: Path) -> PreTrainedModel:
    """Fine-tune `model` with LoRA, save `run_dir/adapter`, and return the adapted model (in memory)."""
    train_rows = to_prompt_completion(data.splits["train"], cfg.prompt, data.labels)
    val_rows = to_prompt_completion(data.splits["validation"], cfg.prompt, data.labels)
    checkpoints = run_dir / "checkpoints"
    args = sft_config(cfg, precision, checkpoints, has_validation=len(val_rows) > 0,
                      use_cpu=model.device.type == "cpu")
    _announce_schedule(cfg, len(train_rows), args.world_size)

    tokenizer.padding_side = "right"  # training pads on the right; evaluation switches to left
    no_match = UserError(f"LoRA matched no module: lora.target_modules={cfg.lora.target_modules!r} found nothing to "
                         f"adapt in {type(model).__name__}. Use `all-linear` or names of its linear layers "
                         "(e.g. [q_proj, k_proj, v_proj, o_proj]); refusing to train nothing.")
    try:
        trainer = SFTTrainer(model=model, args=args, train_dataset=train_rows, eval_dataset=val_rows,
                             processing_class=tokenizer, peft_config=lora_config(cfg))
    except ValueError as err:
        if "not found in the base model" in str(err):  # PEFT's own check, raised while wrapping the model
            raise no_match from None
        raise
    trainable, total = _count_parameters(trainer.model)
    if trainable == 0:
        raise no_match
    print(f"Trainable parameters: {trainable:,} / {total:,} ({100 * trainable / total:.2f}%)", flush=True)

    last = get_last_checkpoint(str(checkpoints)) if checkpoints.is_dir() else None
    if last:
        print(f"Resuming training from {last}", flush=True)
    trainer.train(resume_from_checkpoint=last)

    adapted = trainer.model
    adapted.config.use_cache = True  # training turned the KV cache off; generation wants it back
    if trainer.is_world_process_zero():
        save_adapter(adapted, tokenizer, data, cfg, run_dir / "adapter")
        (run_dir / "train").mkdir(exist_ok=True)
        (run_dir / "train" / "log_history.json").write_text(json.dumps(trainer.state.log_history, indent=2))
    return adapted


def save_adapter(model, tokenizer, data: LabeledData, cfg: RunConfig, target: Path) -> None:
    """Adapter weights + config, tokenizer (with its chat template), and the labels and prompt to reuse it."""
    partial = target.with_name(target.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    meta = {
        "labels": data.labels,
        "system_prompt": system_prompt(cfg.prompt, data.labels),
        "system_prompt_template": cfg.prompt.system_prompt,
        "user_template": cfg.prompt.user_template,
        "base_model": cfg.model.source,
        "eval": cfg.eval.model_dump(),
    }
    (partial / ADAPTER_META).write_text(json.dumps(meta, indent=2, ensure_ascii=False))
    if target.exists():
        shutil.rmtree(target)
    os.replace(partial, target)


def _announce_schedule(cfg: RunConfig, rows: int, world_size: int) -> None:
    t = cfg.train
    effective = t.batch_size * t.gradient_accumulation_steps * world_size
    steps = t.max_steps if t.max_steps > 0 else math.ceil(t.num_train_epochs * math.ceil(rows / effective))
    print(f"Training rows {rows}; batch {t.batch_size} x accumulation {t.gradient_accumulation_steps} x processes "
          f"{world_size} => effective batch {effective}; optimizer steps {steps} "
          f"(≈ {steps * effective / rows:.2f} epochs)", flush=True)


def _count_parameters(model) -> tuple[int, int]:
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    return trainable, total
