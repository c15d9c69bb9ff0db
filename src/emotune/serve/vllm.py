"""`serve.engine=vllm`: hand the adapters to `vllm serve` with hot-loaded LoRA, after checking vLLM can load them."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

from emotune.core.config.run import RunConfig
from emotune.core.errors import UserError
from emotune.deploy.export import adapter_config, max_lora_rank, vllm_base_reference, vllm_blockers
from emotune.deploy.vllm_ready import max_model_len_args
from emotune.model.artifacts import Fallback, find_artifact
from emotune.serve.engine import check_base
from emotune.serve.http import resolve_key


def serve_with_vllm(cfg: RunConfig, targets: list[str], fallback: Fallback | None = None) -> None:
    if importlib.util.find_spec("vllm") is None:
        raise UserError("serve.engine=vllm needs the `vllm` package, which is not installed here (it needs a CUDA or "
                        "ROCm GPU). Install vllm, or use serve.engine=native.")
    artifacts = [find_artifact(t, fallback=fallback) for t in targets]
    if not artifacts or any(a.merged for a in artifacts):
        raise UserError("serve.engine=vllm serves run or adapter folders; for a merged model run its serve_merged.sh.")
    heads = [a.name for a in artifacts if a.has_head]
    if heads:
        raise UserError(f"{heads} are classification-head models, which answer with label probabilities through "
                        "emotune's own engine (/v1/classify). Use serve.engine=native for them.")
    for artifact in artifacts:
        blockers = vllm_blockers(artifact.path)
        if blockers:
            raise UserError(f"vLLM cannot hot-load adapter `{artifact.name}`: {'; '.join(blockers)}. Use "
                            f"`emotune export {artifact.path.parent} --merge --vllm` and its serve_merged.sh.")
        check_base(artifact, artifacts[0].model_cfg.source)
    base, extra = vllm_base_reference(artifacts[0].model_cfg)
    rank = max(max_lora_rank(adapter_config(a.path)) for a in artifacts)
    args = ["serve", base, *extra, "--enable-lora", "--max-lora-rank", str(rank), "--max-loras", str(len(artifacts)),
            "--lora-modules", *(f"{a.name}={a.path.resolve()}" for a in artifacts),
            "--host", cfg.serve.host, "--port", str(cfg.serve.port), "--generation-config", "auto",
            *max_model_len_args(*artifacts)]
    api_key = resolve_key(cfg.serve.api_key, "api_key")
    executable = shutil.which("vllm", path=str(Path(sys.executable).parent)) or shutil.which("vllm") or "vllm"
    print(f"Starting: vllm {' '.join(args)}" + (" (API key in VLLM_API_KEY)" if api_key else ""), flush=True)
    subprocess.run([executable, *args], env=vllm_environment(api_key), check=False)


def vllm_environment(api_key: str | None) -> dict[str, str]:
    """vLLM reads its key from VLLM_API_KEY: an `--api-key` argument would show in the process list."""
    env = {k: v for k, v in os.environ.items() if k != "VLLM_API_KEY"}
    return {**env, "VLLM_API_KEY": api_key} if api_key else env
