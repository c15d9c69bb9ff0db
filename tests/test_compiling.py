"""emotune.train.compiling (train.compile): which devices compile, the refusal before loading, compiled decoder layers
giving eager's losses with dropout 0, and a real compiler failure (no C++ compiler) falling back to eager once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from emotune.core.config.train import TrainConfig
from emotune.core.errors import UserError
from emotune.train import compiling

ROOT = Path(__file__).resolve().parent.parent
# A tiny Gemma 3 with LoRA on every linear layer, the lean forwards and non-reentrant checkpointing (as training runs
# it), eager, then with train.compile=on: prints the losses, the gradients' largest relative difference, what was
# recorded and the graphs compiled.
SCRIPT = """
import json, sys
sys.path.insert(0, "tests")
import torch
from test_lean_lora import _model, _loss_and_grads
from emotune.core.config.train import TrainConfig
from emotune.model import lean_lora, lean_norm
from emotune.train import compiling
model = _model(torch.float32, dropout=0.0)
model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
lean_lora.install(model)
lean_norm.install(model)
eager, eager_grads = _loss_and_grads(model)
recorded = []
state = compiling.install(model, TrainConfig(compile="on"), torch.device("cpu"), lambda key, value: recorded.append(value))
compiled, grads = _loss_and_grads(model)
again, _ = _loss_and_grads(model)
diff = max(float((grads[k] - g).abs().max() / g.abs().max()) for k, g in eager_grads.items())
from torch._dynamo.utils import counters
print(json.dumps({"eager": float(eager), "compiled": float(compiled), "again": float(again), "grad_diff": diff,
                  "state": state, "recorded": recorded, "graphs": counters["stats"]["unique_graphs"]}))
"""


def _run(tmp_path: Path, **env: str) -> tuple[dict, str]:
    environment = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"),
                   **env}  # a fresh compiler cache: a cached graph would skip the compiler
    done = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=environment, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stdout


def test_auto_compiles_on_gpus_with_triton_only_and_on_is_refused_with_fsdp():
    assert compiling.wanted(TrainConfig(), torch.device("cpu"))[0] is False
    assert compiling.wanted(TrainConfig(compile="on"), torch.device("cpu")) == (True, "train.compile=on")
    assert compiling.wanted(TrainConfig(compile="off"), torch.device("cuda"))[0] is False
    assert compiling.wanted(TrainConfig(fsdp=True), torch.device("cuda"))[0] is False
    assert TrainConfig.model_validate({"compile": True}).compile == "on"  # YAML's bare `on`
    assert TrainConfig.model_validate({"compile": False}).compile == "off"
    with pytest.raises(UserError, match="train.compile=off"):
        compiling.check(TrainConfig(compile="on", fsdp=True), torch.device("cuda"))
    compiling.check(TrainConfig(compile="on"), torch.device("cpu"))


def test_no_cpp_compiler_falls_back_to_eager_once_and_says_why(tmp_path):
    """A real failure: inductor reads the C++ compiler from $CXX when it is imported; one that does not exist fails
    the first compiled call, which then runs eager (the same loss as eager, bit for bit)."""
    result, out = _run(tmp_path, CXX=str(tmp_path / "no-such-c++"))
    assert out.count("train.compile: compiling the decoder layers failed") == 1, out
    assert "C++ compiler" in out
    assert result["compiled"] == result["eager"] == result["again"] and result["grad_diff"] == 0.0
    assert result["state"]["layers"] == 0 and "InvalidCxxCompiler" in result["state"]["fallback"]
    assert [r["layers"] for r in result["recorded"]] == [2, 0] and "fallback" in result["recorded"][-1]


@pytest.mark.slow
def test_compiled_layers_give_eager_losses_and_gradients(tmp_path):
    """`on` on a CPU (needs a C++ compiler): about a minute and a half on 2 shared cores for the two kinds of layer."""
    result, out = _run(tmp_path)
    assert "failed" not in out and result["state"]["layers"] == 2 and "fallback" not in result["state"]
    assert result["graphs"] >= 2  # compiled, not run eager after a break in the trace (one graph per kind of layer)
    assert result["compiled"] == pytest.approx(result["eager"], rel=1e-5)  # fp32, dropout 0: rounding alone
    assert result["again"] == pytest.approx(result["eager"], rel=1e-5)
    assert result["grad_diff"] < 1e-4
