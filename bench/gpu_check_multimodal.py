"""The GPU check's multimodal path: emotune on Gemma 4 E4B as `AutoModelForCausalLM` really loads it, the multimodal
wrapper Gemma4ForConditionalGeneration, with random weights in the precision emotune picks (bf16 on a GPU).

    PYTHONPATH=src python bench/gpu_check.py --multimodal [--steps 4] [--out gpu_check.jsonl]
    PYTHONPATH=src python bench/gpu_check.py --multimodal --dry-run   # a tiny config of the same classes, CPU, fp32

The config is google/gemma-4-E4B-it's: gpu_check.E4B_TEXT for the text model (soft-cap 30 in text_config, as in the
released file), transformers' Gemma4VisionConfig and Gemma4AudioConfig defaults for the towers (the E2B/E4B towers),
the special-token ids set to the word tokenizer's. Nothing is downloaded. One JSON line per measure:
  mm_model    class, parameters, seconds to build, memory
  mm_loss     emotune's completion loss (emotune.train.batches.completion_loss) against the model's own (labels passed to
              its forward), on one batch of the recipe's rows: the plain path and the chunked one (CHUNK_TOKENS made
              smaller than the batch's loss positions); relative gaps
  mm_scores   emotune's label probabilities (emotune.eval.scoring) against softmax over labels of the summed log_softmax
              of the model's own fp32 logits on prompt + label tokens; largest absolute gap, top-1 agreement
  mm_train    emotune's training for --steps steps: every logged loss, whether all are finite
  mm_export   (unless --no-export) the trained adapter exported merged (`emotune export --merge`) and reloaded with
              AutoModelForCausalLM: its class, what AutoProcessor loads from it (or why not), its files, and the
              largest logit gap against the adapter on its base, both in the weights' dtype on the device; seconds
"""

from __future__ import annotations

import contextlib
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import torch

# The dry run's towers: the same classes, shrunk.
TINY_VISION = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                   head_dim=8, position_embedding_size=64)
TINY_AUDIO = dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, subsampling_conv_channels=[8, 4],
                  output_proj_dims=16)
MEDIA_TOKENS = {"image_token_id": "<|image|>", "boi_token_id": "<|image>", "eoi_token_id": "<image|>",
                "audio_token_id": "<|audio|>", "boa_token_id": "<|audio>", "eoa_token_index": "<audio|>",
                "video_token_id": "<|video|>"}


def run(args, emit, tokenizer, rows, data, cfg, precision, device, text: dict, memory) -> int:
    tokenizer.add_special_tokens({"additional_special_tokens": list(MEDIA_TOKENS.values())})
    model, line = build_multimodal(text, args.dry_run, tokenizer, precision.dtype, device, memory)
    emit(line)
    emit(loss_gaps(model, tokenizer, rows[: cfg.train.batch_size], device))
    emit(score_gaps(model, tokenizer, data, cfg, args.eval_rows))
    with tempfile.TemporaryDirectory() as folder:
        if not args.no_export:  # the base as built, before training puts LoRA layers into it, with E4B's processor
            model.save_pretrained(Path(folder) / "base")
            tokenizer.save_pretrained(Path(folder) / "base")
            write_processor_config(Path(folder) / "base")
        line, adapted = train_steps(model, tokenizer, rows, cfg, precision, Path(folder))
        emit(line)
        if not args.no_export:
            emit(export_and_reload(adapted, tokenizer, data, cfg, device, Path(folder)))
    return 0


def build_multimodal(text: dict, tiny: bool, tokenizer, dtype: torch.dtype, device: torch.device, memory):
    from transformers import AutoModelForCausalLM, Gemma4AudioConfig, Gemma4Config, Gemma4TextConfig, Gemma4VisionConfig

    text = {**text, "vocab_size": max(text["vocab_size"], len(tokenizer)),
            "vocab_size_per_layer_input": max(text["vocab_size_per_layer_input"], len(tokenizer))}
    text_config = Gemma4TextConfig(**text, pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                                   eos_token_id=tokenizer.eos_token_id)
    ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in MEDIA_TOKENS.items()}
    config = Gemma4Config(text_config=text_config.to_dict(),
                          vision_config=Gemma4VisionConfig(**(TINY_VISION if tiny else {})).to_dict(),
                          audio_config=Gemma4AudioConfig(**(TINY_AUDIO if tiny else {})).to_dict(), **ids)
    torch.manual_seed(0)
    started = time.perf_counter()
    with torch.device(device):  # attention: transformers' choice per tower (the audio tower has no SDPA path)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    line = {"measure": "mm_model", "class": type(model).__name__, "parameters": sum(p.numel() for p in model.parameters()),
            "attention": model.config.get_text_config()._attn_implementation,
            "dtype": str(dtype).removeprefix("torch."), "softcap": model.config.get_text_config().final_logit_softcapping,
            "build_s": round(time.perf_counter() - started, 1), **memory(device)}
    return model, line


@torch.no_grad()
def loss_gaps(model, tokenizer, rows, device) -> dict:
    """emotune's summed completion loss over its token count against the model's own mean loss on the same labels."""
    from emotune.train.batches import collate, completion_loss

    model.eval()
    batch = collate(rows, tokenizer.pad_token_id, device)
    labels = torch.full_like(batch["input_ids"], -100)
    keep = batch["predicts"][:, :-1]
    labels[:, 1:][keep] = batch["input_ids"][:, 1:][keep]
    own = float(model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=labels).loss)
    line = {"measure": "mm_loss", "rows": len(rows), "loss_tokens": int(batch["targets"].numel()), "model_loss": own}
    for path, chunk in (("plain", 1 << 30), ("chunked", max(1, int(batch["targets"].numel()) // 3))):
        parts = completion_loss(model, batch, chunk_tokens=chunk)
        ours = float(parts.loss_sum) / parts.tokens
        line[path] = {"emotune_loss": ours, "relative_gap": abs(ours - own) / max(abs(own), 1e-12), "chunk_tokens": chunk}
    return line


@torch.no_grad()
def score_gaps(model, tokenizer, data, cfg, rows: int) -> dict:
    from emotune.data import prompt_messages
    from emotune.eval.scoring import label_token_ids, score_label_probs

    texts = list(data.splits["test"]["text"][:min(rows, 8)])
    model.eval()
    ours = score_label_probs(model, tokenizer, texts, cfg.prompt, data.labels, batch_size=4).float()
    sequences = label_token_ids(tokenizer, cfg.prompt, data.labels)
    device = next(model.parameters()).device
    reference = []
    for text in texts:
        prompt = tokenizer.apply_chat_template(prompt_messages(text, cfg.prompt, data.labels), tokenize=True,
                                               add_generation_prompt=True, return_dict=False)
        per_label = []
        for seq in sequences:
            ids = torch.tensor([list(prompt) + seq], device=device)
            logp = model(input_ids=ids).logits[0, len(prompt) - 1:-1].float().log_softmax(-1)
            per_label.append(float(logp.gather(-1, torch.tensor(seq, device=device)[:, None]).sum()))
        reference.append(torch.tensor(per_label).softmax(-1))
    reference = torch.stack(reference)
    return {"measure": "mm_scores", "rows": len(texts), "labels": len(data.labels),
            "max_abs_gap": float((ours - reference).abs().max()),
            "top1_agreement": float((ours.argmax(-1) == reference.argmax(-1)).float().mean())}


def train_steps(model, tokenizer, rows, cfg, precision, folder: Path) -> tuple[dict, object]:
    from emotune.core.rundir import RunDir
    from emotune.train.loop import train

    started = time.perf_counter()
    with contextlib.redirect_stdout(sys.stderr):
        adapted = train(model, tokenizer, rows, [], cfg, precision, RunDir(folder / "run"),
                        {"labels": [], "base_model": str(folder / "base")})
    history = json.loads((folder / "run" / "train" / "log_history.json").read_text())
    losses = [e["loss"] for e in history if "loss" in e]
    return {"measure": "mm_train", "steps": len(losses), "losses": [round(x, 4) for x in losses],
            "finite": bool(losses) and all(math.isfinite(x) for x in losses),
            "seconds": round(time.perf_counter() - started, 1)}, adapted


@torch.no_grad()
def export_and_reload(adapted, tokenizer, data, cfg, device, folder: Path) -> dict:
    """The base (saved before training), the trained adapter exported merged in the weights' dtype and reloaded as a user would load it,
    against the adapter on its base (`adapted`, as training returned it)."""
    import yaml
    from transformers import AutoModelForCausalLM

    from emotune.deploy.export import export

    started = time.perf_counter()
    dtype = next(adapted.parameters()).dtype
    meta_path = folder / "run" / "adapter" / "emotune.json"
    meta = {**json.loads(meta_path.read_text()), **_classify_meta(cfg, data)}
    meta_path.write_text(json.dumps(meta))
    (folder / "run" / "config.yaml").write_text(yaml.safe_dump({"model": {"source": str(folder / "base")}}))
    with contextlib.redirect_stdout(sys.stderr):
        out = export(folder / "run", out=folder / "export", merge=True, dtype=str(dtype).removeprefix("torch."))
    merged = AutoModelForCausalLM.from_pretrained(out / "merged", dtype=dtype).to(device).eval()
    ids = torch.tensor([rows_ids for rows_ids in _prompt_ids(tokenizer, data, cfg)[:1]], device=device)
    adapted.eval()
    gap = float((merged(input_ids=ids).logits.float() - adapted(input_ids=ids).logits.float()).abs().max())
    files = sorted(p.name for p in (out / "merged").iterdir())
    return {"measure": "mm_export", "class": type(merged).__name__, "processor": _processor_class(out / "merged"),
            "max_logit_gap": gap,
            "dtype": str(dtype).removeprefix("torch."), "files": files, "seconds": round(time.perf_counter() - started, 1)}


# Gemma4VideoProcessor's settings (its class defaults in transformers 5.25), written out: building it needs torchvision.
VIDEO_PROCESSOR = {"video_processor_type": "Gemma4VideoProcessor", "resample": 3, "image_mean": [0.0, 0.0, 0.0],
                   "image_std": [1.0, 1.0, 1.0], "do_convert_rgb": True, "do_resize": True, "do_rescale": True,
                   "rescale_factor": 1 / 255, "do_normalize": True, "num_frames": 32, "do_sample_frames": True,
                   "patch_size": 16, "max_soft_tokens": 70, "pooling_kernel_size": 3}


def write_processor_config(folder: Path) -> None:
    """E4B's processor_config.json (image processor: patch 16, pooling 3, 280 soft tokens; audio feature extractor), in
    transformers 5's one-file layout, written from the parts: Gemma4Processor itself needs torchvision to be built."""
    from transformers.models.gemma4.feature_extraction_gemma4 import Gemma4AudioFeatureExtractor
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    image = json.loads(Gemma4ImageProcessorPil(patch_size=16, pooling_kernel_size=3, max_soft_tokens=280).to_json_string())
    config = {"processor_class": "Gemma4Processor", "image_processor": image,
              "feature_extractor": json.loads(Gemma4AudioFeatureExtractor().to_json_string()),
              "video_processor": VIDEO_PROCESSOR, "image_seq_length": 280, "audio_seq_length": 750, "audio_ms_per_token": 40}
    (folder / "processor_config.json").write_text(json.dumps(config, indent=2))


def _processor_class(folder: Path) -> str:
    """What AutoProcessor loads from `folder`, or why it does not (its video processor needs torchvision)."""
    from transformers import AutoProcessor

    try:
        return type(AutoProcessor.from_pretrained(folder)).__name__
    except Exception as err:  # noqa: BLE001 (reported, not raised: the other measures stand)
        return f"not loaded: {type(err).__name__}: {str(err).strip().splitlines()[0][:200] if str(err).strip() else ''}"


def _classify_meta(cfg, data) -> dict:
    from emotune.data import system_prompt

    return {"task": "classify", "labels": data.labels, "system_prompt": system_prompt(cfg.prompt, data.labels),
            "system_prompt_template": cfg.prompt.system_prompt, "user_template": cfg.prompt.user_template}


def _prompt_ids(tokenizer, data, cfg) -> list[list[int]]:
    from emotune.data import prompt_messages

    return [tokenizer.apply_chat_template(prompt_messages(t, cfg.prompt, data.labels), tokenize=True,
                                          add_generation_prompt=True, return_dict=False)
            for t in data.splits["test"]["text"][:2]]
