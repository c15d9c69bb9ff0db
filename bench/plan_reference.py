"""`emotune plan` for the reference recipe on the GPUs users have: 16, 24 and 48 GB, unquantized, 8-bit and 4-bit.

    PYTHONPATH=src python bench/plan_reference.py [--memory 16GB 24GB 48GB] [--quantization none 8bit 4bit]
                                                  [--data DIR] [--set KEY=VALUE ...]

Nothing is downloaded and no weight is read: a folder holds google/gemma-4-E4B-it's configuration as it loads
(`Gemma4ForConditionalGeneration`: E4B's text model, bench/gpu_check.py's E4B_TEXT, with transformers' Gemma 4
vision and audio towers) and, as a stand-in for its tokenizer, the packaged Gemma 3 270M's (the same 262,144-entry
vocabulary; token counts of the rows are about the same, the chat template's markers differ by a few tokens).
`emotune plan configs/gemma4-e4b-emotion.yaml` then runs once per memory size and `model.quantization`, with
the emotion set as data when `--data` is given (else the recipe's own source, which needs the hub). Each line: the
setting, the verdict, the peak and its stage, the training peak's parts, and the first change `plan` proposes.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_check import E4B_TEXT, RECIPE, ROOT  # noqa: E402

GIB = 2**30


def reference_folder(folder: Path) -> Path:
    """E4B's configuration (no weights) with the packaged model's tokenizer beside it."""
    from transformers import Gemma4AudioConfig, Gemma4Config, Gemma4TextConfig, Gemma4VisionConfig

    from emotune.core.config.model import ModelConfig
    from emotune.model.loading import load_tokenizer, resolve_model_dir

    config = Gemma4Config(text_config=Gemma4TextConfig(**E4B_TEXT).to_dict(), vision_config=Gemma4VisionConfig().to_dict(),
                          audio_config=Gemma4AudioConfig().to_dict())
    config.architectures = ["Gemma4ForConditionalGeneration"]
    config.save_pretrained(folder)
    load_tokenizer(resolve_model_dir(ModelConfig()), ModelConfig()).save_pretrained(folder)
    return folder


def plan(folder: Path, memory: str, quantization: str, extra: list[str]) -> dict:
    command = [sys.executable, "-m", "emotune", "plan", str(RECIPE), f"model.source={folder}",
               f"model.quantization={quantization}", "--device-memory", memory, "--json", *extra]
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    if done.returncode != 0:
        return {"memory": memory, "quantization": quantization, "error": done.stderr.strip().splitlines()[-1:]}
    found = json.loads(done.stdout)
    training = found["training"]
    setting = "checkpointing" if training["gradient_checkpointing"] else "no_checkpointing"
    first_fix = found["fixes"][0] if found["fixes"] else None
    return {"memory": memory, "quantization": quantization, "verdict": found["verdict"],
            "peak_gib": round(found["peak"]["bytes"] / GIB, 2), "peak_stage": found["peak"]["stage"],
            "parameters": found["parameters"], "trainable_parameters": found["trainable_parameters"],
            "gradient_checkpointing": training["gradient_checkpointing"],
            "training_gib": {part: round(n / GIB, 2) for part, n in training[setting].items()},
            "first_fix": first_fix}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--memory", nargs="+", default=["16GB", "24GB", "48GB"])
    parser.add_argument("--quantization", nargs="+", default=["none", "8bit", "4bit"], choices=["none", "8bit", "4bit"])
    parser.add_argument("--data", type=Path, default=None, help="a local copy of the emotion set (train/validation/test)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="more overrides for every plan")
    args = parser.parse_args(argv)
    extra = ([f"data.source={args.data}"] if args.data else []) + args.set
    with tempfile.TemporaryDirectory() as scratch:
        folder = reference_folder(Path(scratch) / "gemma-4-E4B-it-config")
        for memory in args.memory:
            for quantization in args.quantization:
                print(json.dumps(plan(folder, memory, quantization, extra)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
