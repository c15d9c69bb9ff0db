"""Any run or adapter folder name works: the name is a label users see, never a module attribute.

The README's own run is `runs/cpu`; `cpu` is a method of every torch module, and PEFT once took the folder's
name as the adapter name, so `emotune predict runs/cpu ...` and `emotune serve runs/cpu` ended in
`KeyError: "attribute 'cpu' already exists"`.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from conftest import LABELS
from emotune.cli import main
from emotune.model.artifacts import find_artifact, peft_adapter_name

NAMES = ["cpu", "cuda", "to", "eval", "default"]
TEXTS = ["i am so happy today", "my friend was furious"]


@pytest.fixture(scope="module")
def named_runs(tiny_run_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("named")
    for name in NAMES:
        shutil.copytree(tiny_run_dir, root / name)
    return root


def _predictions(capsys) -> list[dict]:
    return [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]


def test_peft_names_are_identifiers_that_keep_names_apart():
    names = [*NAMES, "a.b", "a_b", "a-b", "运行"]
    peft_names = [peft_adapter_name(n) for n in names]
    assert len(set(peft_names)) == len(names)
    module = torch.nn.Linear(1, 1)
    for peft_name in peft_names:
        assert peft_name.isidentifier() and not hasattr(module, peft_name)


@pytest.mark.parametrize("name", NAMES)
def test_predict_on_a_run_and_its_adapter_folder_named_like_a_module_attribute(named_runs, tiny_run_dir, name, capsys):
    assert main(["predict", str(tiny_run_dir), *TEXTS]) == 0
    reference = _predictions(capsys)
    for target in (named_runs / name, named_runs / name / "adapter"):
        assert main(["predict", str(target), *TEXTS]) == 0, capsys.readouterr().err
        got = _predictions(capsys)
        assert [g["label"] for g in got] == [r["label"] for r in reference]
        for g, r in zip(got, reference, strict=False):
            assert g["probs"] == pytest.approx(r["probs"], abs=1e-5)


def test_serve_engine_holds_adapters_named_like_module_attributes(named_runs):
    from emotune.core.config.load import load_config
    from emotune.serve.engine import build_engine

    cfg = load_config(None, ["model.dtype=float32"])
    engine, artifacts = build_engine(cfg, [str(named_runs / name) for name in NAMES])
    assert sorted(engine.models) == sorted([*NAMES, "base"])
    artifact = artifacts[0]
    assert artifact.labels == LABELS
    prompt = artifact.prompt
    probs = {name: engine.classify(name, TEXTS, prompt, artifact.labels, 2) for name in NAMES}
    for name in NAMES[1:]:  # the same adapter under five names: the same answers
        torch.testing.assert_close(probs[name], probs[NAMES[0]], atol=1e-5, rtol=0)
    base = engine.classify("base", TEXTS, prompt, artifact.labels, 2)
    assert not torch.allclose(base, probs["cpu"], atol=1e-4)  # the adapter is really applied
    engine.remove_adapter("cpu")
    engine.remove_adapter("eval")
    torch.testing.assert_close(engine.classify("to", TEXTS, prompt, artifact.labels, 2), probs["to"], atol=1e-5, rtol=0)
    assert find_artifact(named_runs / "default").name == "default"


@pytest.mark.parametrize("name", ["cpu", "eval"])
def test_export_merge_of_runs_named_like_module_attributes(named_runs, name, tmp_path):
    out = tmp_path / "export"
    assert main(["export", str(named_runs / name), "--merge", "--dtype", "float32", "--out", str(out)]) == 0
    assert (out / "merged" / "config.json").is_file() and (out / "adapter" / "adapter_config.json").is_file()


def test_compare_on_runs_named_like_module_attributes(tmp_path, capsys):
    from test_compare import _predictions, make_run

    targets = [str(make_run(tmp_path / "runs", name, {"score": _predictions(0.5 + 0.1 * i, seed=i)}))
               for i, name in enumerate(NAMES)]
    out = tmp_path / "compare"
    assert main(["compare", *targets, "--out", str(out)]) == 0, capsys.readouterr().err
    compared = (out / "compare.json").read_text(encoding="utf-8")
    assert all(f'"{name}"' in compared for name in NAMES)  # each run by its folder name
