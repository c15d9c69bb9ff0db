"""Export from a QLoRA run (`model.quantization: 4bit | 8bit`): merged onto the unquantized base, and what that changes.

The adapter was trained over the base's quantized weights, but what users deploy is a full-precision model. So
the merge is PEFT's merge onto the base loaded unquantized (in fp32 on the CPU, as every export merges, then saved
in the export dtype), never onto the 4-bit weights, where the sum would be rounded back to 4 bits. Two numbers
say what that gives, both printed and written to `merged/emotune_merge.json`:

    parity        the merged folder (read back in fp32) vs the adapter on that unquantized base: the merge itself
    quantization  the adapter on the unquantized base vs the adapter on the quantized base it was trained and
                  evaluated on: what leaving the quantized weights changes (the run's before/after numbers were
                  measured on the quantized base)

Both are the largest |logit difference| over a few prompts, built the way the model is used (a classifier's chat
prompt with its labels, an sft model's user turn, a head model's text).
"""

from __future__ import annotations

from pathlib import Path

import torch

from emotune.core.config.model import ModelConfig
from emotune.core.rundir import json_text
from emotune.model import quantization
from emotune.model.artifacts import Artifact

REPORT = "emotune_merge.json"
SAMPLE_TEXTS = ("i feel so lonely today", "what a wonderful surprise this morning", "my friend was furious with me",
                "i am scared of the dark")


@torch.inference_mode()
def merge_report(artifact: Artifact, merged_dir: Path, parity: float, full, texts: tuple[str, ...] = SAMPLE_TEXTS) -> dict:
    """Measure the quantization gap of a merged QLoRA export and print it with the merge's `parity` (measured by
    emotune.deploy.export on `texts`), and write both next to the merged folder. `full` is the adapter on the
    unquantized base in fp32 on the CPU."""
    from emotune.model.loading import load_model

    base_dir = artifact.base_dir()
    cpu = torch.device("cpu")
    full = full.eval()
    quantized = quantization.bnb_config(artifact.model_cfg, torch.float32, base_dir)
    quantized_base = load_model(base_dir, torch.float32, cpu, quantized=quantized)
    on_quantized = _with_adapter(artifact, quantized_base).eval()
    gap = max((_logits(full, ids) - _logits(on_quantized, ids)).abs().max().item() for ids in _inputs(artifact, texts))
    record = {
        "quantization": artifact.model_cfg.quantization,
        "merged_onto": "the unquantized base (fp32 merge), saved in the export dtype",
        "parity_max_abs_logit_diff": parity,
        "quantized_base_max_abs_logit_diff": gap,
        "texts": len(texts),
        "note": "parity: merged folder vs adapter on the unquantized base; quantized_base: adapter on the unquantized "
                "base vs adapter on the quantized base it was trained and evaluated on",
    }
    (merged_dir / REPORT).write_text(json_text(record), encoding="utf-8")
    print(f"Merged onto the unquantized base (the run trained on a {artifact.model_cfg.quantization} base): largest "
          f"logit difference to the adapter on that base {parity:.2e} (the merge), to the adapter on the "
          f"{artifact.model_cfg.quantization} base it was trained on {gap:.2e} (leaving the quantized weights); "
          f"in {merged_dir.name}/{REPORT}", flush=True)
    return record


def _with_adapter(artifact: Artifact, base):
    from peft import PeftModel

    from emotune.model.head import classifier_from_causal

    if artifact.has_head:
        base = classifier_from_causal(base, artifact.labels)
    return PeftModel.from_pretrained(base, artifact.path)


def _inputs(artifact: Artifact, texts: tuple[str, ...]) -> list[torch.Tensor]:
    from emotune.model.head import encode_texts
    from emotune.model.loading import load_tokenizer

    tokenizer = load_tokenizer(artifact.path, ModelConfig())
    if artifact.has_head:
        return [torch.tensor([ids]) for ids in encode_texts(list(texts), tokenizer, artifact.max_length)]
    return [tokenizer(artifact.chat_prompt(tokenizer, t), return_tensors="pt", add_special_tokens=False)["input_ids"]
            for t in texts]


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids).logits.float()
