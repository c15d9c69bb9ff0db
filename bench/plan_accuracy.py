"""How close `emotune plan`'s memory estimate comes to the measured peak of real training steps and generation.

    PYTHONPATH=src python bench/plan_accuracy.py [--model tiny|small|gemma-3-270m|wide-vocab] [--length 128]
        [--rows 4] [--dtype float32|bfloat16] [--quantization none|8bit|4bit] [--optim adamw_torch|adamw_8bit]
        [--finetuning lora|full|freeze] [--freeze-layers N] [--softcap 30] [--smoke]

For each setting (gradient checkpointing on/off x a classification row, whose loss is on 3 tokens, or an
sft row, whose loss is on every token) it builds the model from its config with zero weights (no
download: `gemma-3-270m` is the packaged model's architecture), estimates with emotune.train.memory, trains
2 steps with emotune's own loop (emotune.train.loop.train) on rows of exactly `--length` tokens while
emotune.train.probe.TensorPeak records the peak of the tensors alive, and prints one JSON line per setting:
estimate, measured (weights + peak), their ratio. Then the same for one batch of greedy generation. Only
tensors are compared: neither number holds the allocator's cached blocks or the Python process.
`--quantization 8bit|4bit`: the base's linear layers quantized by bitsandbytes as `model.quantization` loads them
(the model is saved with small random weights and loaded through emotune.model.loading.load_model with the run's
BitsAndBytesConfig; zeros would quantize to NaN scales), trained as a QLoRA run trains it; the quantized weights'
packed bytes and their quantization constants count as weights. `--optim adamw_8bit`: bitsandbytes' 8-bit AdamW state.
`--finetuning full|freeze`: the model's own weights trained (freeze: the last `--freeze-layers` layers), kept in fp32
while training as emotune keeps them (their bf16 originals, freed then, are not counted).
`--softcap C`: a final logit soft-cap as Gemma 2's (`wide-vocab`: a 16,384-entry vocabulary, so that the loss's
buffers, chunked past emotune.train.batches.CHUNK_TOKENS loss positions, make the peak).
`--smoke`: the tiny model, short rows, one setting of each (what tests/test_plan.py runs).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

from emotune.core.config.load import load_config
from emotune.core.rundir import RunDir
from emotune.runtime.device import Precision
from emotune.train.batches import Example
from emotune.train.memory import Evaluation, Workload, describe, evaluation_parts, training_parts
from emotune.train.probe import TensorPeak

# The packaged model's architecture (its config.json after conversion), so no weights need converting.
GEMMA_3_270M = dict(vocab_size=262144, hidden_size=640, intermediate_size=2048, num_hidden_layers=18,
                    num_attention_heads=4, num_key_value_heads=1, head_dim=256, max_position_embeddings=32768,
                    sliding_window=512, query_pre_attn_scalar=256, rms_norm_eps=1e-6, final_logit_softcapping=None,
                    layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 3,
                    rope_parameters={"full_attention": {"rope_theta": 1e6, "rope_type": "default"},
                                     "sliding_attention": {"rope_theta": 1e4, "rope_type": "default"}})
MODELS = {
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=1, head_dim=16, max_position_embeddings=1024, sliding_window=64),
    "small": dict(vocab_size=4096, hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=1, head_dim=64, max_position_embeddings=1024, sliding_window=64),
    "gemma-3-270m": GEMMA_3_270M,
    # a vocabulary large against the rest, so the loss's buffers (chunked past CHUNK_TOKENS positions) are the peak
    "wide-vocab": dict(vocab_size=16384, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=1, head_dim=16, max_position_embeddings=2048,
                       sliding_window=64),
}
CLASSIFY_LOSS_TOKENS = 3


def model_config(name: str, softcap: float | None = None):
    """`softcap`: a final logit soft-cap (Gemma 2's `final_logit_softcapping`; Gemma 3's is None)."""
    from transformers import Gemma3TextConfig

    fields = {**MODELS[name], **({"final_logit_softcapping": softcap} if softcap else {})}
    return Gemma3TextConfig(**fields, pad_token_id=0, bos_token_id=2, eos_token_id=1)


def build_model(config, dtype: torch.dtype):
    """The model with every weight zero: memory does not depend on the values, and zeros spare the random
    initialisation (seconds for Gemma 3 270M). Buffers (rotary frequencies, embedding scale) are computed as usual."""
    from accelerate import init_empty_weights

    from emotune.model.text import causal_lm_class

    with init_empty_weights(include_buffers=False):  # the class a run loads it with (vision-language ones too)
        model = causal_lm_class(config).from_config(config, dtype=dtype)
    made: dict[int, torch.nn.Parameter] = {}  # tied weights (embedding and output layer) stay one tensor
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if id(param) not in made:
                made[id(param)] = torch.nn.Parameter(torch.zeros(param.shape, dtype=param.dtype),
                                                     requires_grad=param.requires_grad)
            setattr(module, name, made[id(param)])
    model.tie_weights()  # the embedding and the output layer share one tensor, as the loaded model's do
    return model


class _NoTokenizer:
    """What train() asks of a tokenizer when the adapter or the whole model is written (nothing to write here)."""
    pad_token_id, eos_token_id, chat_template = 0, 1, None

    def save_pretrained(self, path) -> None:
        pass


def measure_training(config, length: int, rows: int, checkpointing: bool, sft: bool,
                     dtype: torch.dtype = torch.float32, quantization: str = "none", optim: str = "adamw_torch",
                     finetuning: str = "lora", freeze_layers: int = 1) -> dict:
    """The estimate of one training setting and the measured peak of 2 steps of emotune's loop on it."""
    with tempfile.TemporaryDirectory(prefix="plan-accuracy-") as folder:  # a run folder, and a full model, per line
        return _measure_training(folder, config, length, rows, checkpointing, sft, dtype, quantization, optim,
                                 finetuning, freeze_layers)


def _measure_training(folder: str, config, length: int, rows: int, checkpointing: bool, sft: bool, dtype: torch.dtype,
                      quantization: str, optim: str, finetuning: str, freeze_layers: int) -> dict:
    from emotune.train.loop import train

    precision = {torch.float32: "fp32", torch.bfloat16: "bf16"}[dtype]
    cfg = load_config(None, [f"output_dir={folder}", "train.max_steps=2", f"train.batch_size={rows}",
                             "train.gradient_accumulation_steps=1", f"train.gradient_checkpointing={checkpointing}",
                             f"train.precision={precision}", f"train.max_length={length}", "train.max_tokens_per_pass=0",
                             "train.eval_steps=100", "train.save_steps=100", "train.logging_steps=1",
                             f"model.quantization={quantization}", f"train.optim={optim}",
                             f"train.finetuning={finetuning}", f"train.freeze_trainable_layers={freeze_layers}"])
    work = Workload(loss_tokens_per_row=None if sft else CLASSIFY_LOSS_TOKENS)
    arch = describe(config, cfg.lora, cfg.train.optim, dtype, work, model_cfg=cfg.model, train=cfg.train)
    estimate = training_parts(arch, work, rows, length, checkpointing, host_copies=False)
    model = build_model(config, dtype) if quantization == "none" else quantized_model(config, cfg.model, dtype, folder)
    generator = torch.Generator().manual_seed(0)
    examples = [Example(torch.randint(3, config.get_text_config().vocab_size, (length,), generator=generator).tolist(),
                        1 if sft else length - CLASSIFY_LOSS_TOKENS) for _ in range(2 * rows)]
    weights = _bytes([*model.parameters(), *model.buffers(), *_quantization_constants(model)])
    with TensorPeak() as tracker:
        trained = train(model, _NoTokenizer(), examples, [], cfg, Precision(precision, "measured"), RunDir(f"{folder}/run"),
                        {})
    if finetuning != "lora" and dtype != torch.float32:  # the trained weights were replaced by fp32 copies (counted by
        weights -= _bytes([p for p in trained.parameters() if p.requires_grad])  # the tracker); their own were freed
    return _line("train", config, length, rows, dtype, sum(estimate.values()), weights + tracker.peak,
                 checkpointing=checkpointing, task="sft" if sft else "classify", quantization=quantization, optim=optim,
                 **({"finetuning": finetuning} if finetuning == "full" else
                    {"finetuning": finetuning, "freeze_trainable_layers": freeze_layers} if finetuning == "freeze" else {}),
                 estimate_parts=estimate)


def quantized_model(config, model_cfg, dtype: torch.dtype, folder: str):
    """The model with small random weights, saved and loaded back quantized, as `model.quantization` loads a base."""
    from transformers import AutoModelForCausalLM

    from emotune.model import quantization
    from emotune.model.loading import load_model

    torch.manual_seed(0)
    config = config.__class__.from_dict({**config.to_dict(), "initializer_range": 0.02})
    AutoModelForCausalLM.from_config(config, dtype=dtype).save_pretrained(f"{folder}/base")
    model = load_model(Path(f"{folder}/base"), dtype, torch.device("cpu"), quantized=quantization.bnb_config(model_cfg, dtype))
    quantization.keep_trainable_layout(model)
    return model


def _quantization_constants(model) -> list[torch.Tensor]:
    """The tensors of bitsandbytes' quantization states (absmax, nested constants, the code), which are not parameters."""
    found: dict[int, torch.Tensor] = {}
    for param in model.parameters():
        state = getattr(param, "quant_state", None)
        for value in (vars(state).values() if state is not None else ()):
            nested = vars(value).values() if hasattr(value, "absmax") else ()
            for tensor in (value, *nested):
                if isinstance(tensor, torch.Tensor):
                    found.setdefault(id(tensor), tensor)
        scale = getattr(param, "SCB", None)  # LLM.int8(): one fp32 scale per output row
        if isinstance(scale, torch.Tensor):
            found.setdefault(id(scale), scale)
    return list(found.values())


@torch.inference_mode()
def measure_generation(config, length: int, rows: int, new_tokens: int = 4, dtype: torch.dtype = torch.float32) -> dict:
    """The estimate of one batch of greedy generation and its measured peak."""
    from emotune.core.config.train import LoraSettings

    evaluation = Evaluation(rows, False, length, new_tokens, projected=1, cache="model")
    arch = describe(config, LoraSettings(), "adamw_torch", dtype, Workload(CLASSIFY_LOSS_TOKENS))
    estimate = evaluation_parts(arch, evaluation) | {"adapters": 0}  # the base model: no adapters here
    model = build_model(config, dtype).eval()
    ids = torch.randint(3, config.get_text_config().vocab_size, (rows, length), generator=torch.Generator().manual_seed(1))
    weights = _bytes([*model.parameters(), *model.buffers()])
    with TensorPeak() as tracker:
        model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                       min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    return _line("generate", config, length, rows, dtype, sum(estimate.values()), weights + tracker.peak,
                 new_tokens=new_tokens, estimate_parts=estimate)


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _line(kind: str, config, length: int, rows: int, dtype, estimate: int, measured: int, **extra) -> dict:
    text = config.get_text_config()
    return {"measure": kind, "hidden_size": text.hidden_size, "layers": text.num_hidden_layers,
            "vocab_size": text.vocab_size, "length": length, "rows": rows, "dtype": str(dtype).removeprefix("torch."),
            **{k: v for k, v in extra.items() if k != "estimate_parts"}, "estimate_bytes": int(estimate),
            "measured_bytes": int(measured), "ratio": round(estimate / measured, 3),
            "estimate_parts": extra.get("estimate_parts")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=list(MODELS), default="small")
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--quantization", choices=["none", "8bit", "4bit"], default="none")
    parser.add_argument("--optim", choices=["adamw_torch", "adamw_8bit"], default="adamw_torch")
    parser.add_argument("--finetuning", choices=["lora", "full", "freeze"], default="lora")
    parser.add_argument("--freeze-layers", type=int, default=1, help="train.freeze_trainable_layers with --finetuning freeze")
    parser.add_argument("--softcap", type=float, default=None, help="a final logit soft-cap, as Gemma 2's")
    parser.add_argument("--smoke", action="store_true", help="the tiny model, 32-token rows, one setting of each")
    args = parser.parse_args()
    if args.smoke:
        args.model, args.length, args.rows = "tiny", 32, 2
    config, dtype = model_config(args.model, args.softcap), getattr(torch, args.dtype)
    settings = [(False, False), (True, True)] if args.smoke else [(gc, sft) for gc in (False, True) for sft in (False, True)]
    for checkpointing, sft in settings:
        print(json.dumps(measure_training(config, args.length, args.rows, checkpointing, sft, dtype, args.quantization,
                                          args.optim, args.finetuning, args.freeze_layers)), flush=True)
    if args.quantization != "none" or args.finetuning != "lora":
        return  # other settings are measured training; generation is measured on unquantized weights, without adapters
    print(json.dumps(measure_generation(config, args.length, args.rows, dtype=dtype)), flush=True)


if __name__ == "__main__":
    main()
