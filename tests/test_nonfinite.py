"""A model whose weights hold NaN (a broken checkpoint, adapter or conversion): `emotune serve` refuses to load it,
naming the weights; a served model that turns out to compute NaN is a 500 that says so (classify, chat, a stream),
not a JSON encoder's error or a reply of padding; `emotune predict`, `emotune eval` and `emotune run`'s measurements
exit 2 with the same message and write nothing."""

from __future__ import annotations

import json
import re

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import write_tiny_adapter
from emotune.cli import main
from emotune.core.config.eval import ServeConfig
from emotune.core.config.load import load_config
from emotune.model.finite import NonFiniteOutput, not_finite_message
from emotune.serve import build_engine, create_app
from server_harness import running

BROKEN = "mlp.down_proj.lora_B"  # NaN there reaches every logit (NaN in a query can vanish inside CPU attention)
SAYS = "computed scores that are not numbers (NaN or infinity)"
ADMIN = {"Authorization": "Bearer admin-key"}


def poison(run_dir):
    """NaN in one LoRA matrix of the run's adapter file, as a diverged or broken checkpoint holds it."""
    path = run_dir / "adapter" / "adapter_model.safetensors"
    weights = load_file(path)
    weights[next(k for k in sorted(weights) if BROKEN in k)].fill_(float("nan"))
    save_file(weights, path)
    return run_dir


@pytest.fixture(scope="module")
def runs(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("nonfinite")
    write_tiny_adapter(tiny_model_dir, root / "good")
    poison(write_tiny_adapter(tiny_model_dir, root / "broken"))
    poison(write_tiny_adapter(tiny_model_dir, root / "chat", task="sft", overrides=("eval.max_new_tokens=3",)))
    return root


def test_serve_refuses_to_load_a_model_whose_weights_hold_nan(runs):
    with pytest.raises(NonFiniteOutput, match=rf"`broken` {re.escape(SAYS)}.*{BROKEN}.*It was not loaded"):
        build_engine(load_config(None, ["device=cpu"]), [str(runs / "broken")])


def test_a_served_model_computing_nan_is_a_500_saying_so_and_a_broken_adapter_load_422(runs):
    engine, _ = build_engine(load_config(None, ["device=cpu"]), [str(runs / "good")])
    with torch.no_grad():  # broken after it loaded (as an overflow on some texts only would show)
        next(p for n, p in engine.model.named_parameters() if BROKEN in n and "good" in n).fill_(float("nan"))
    cfg = ServeConfig(admin_key="admin-key", adapter_dirs=[str(runs)])
    with running(create_app(engine, cfg)) as (url, _), httpx.Client(base_url=url, timeout=60) as http:
        answer = http.post("/v1/classify", json={"model": "good", "input": ["i am happy", "so sad"]})
        assert answer.status_code == 500
        error = answer.json()["error"]
        assert error["type"] == "server_error" and f"`good` {SAYS} for input[0], input[1]" in error["message"]
        chat = {"model": "good", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]}
        for temperature in (0, 1):  # greedy replied with padding, sampling failed inside torch.multinomial
            answer = http.post("/v1/chat/completions", json={**chat, "temperature": temperature})
            assert answer.status_code == 500 and SAYS in answer.json()["error"]["message"]
        events = http.post("/v1/chat/completions", json={**chat, "stream": True}).text.split("\n\n")
        assert SAYS in json.loads(events[-3].removeprefix("data: "))["error"]["message"] and events[-2] == "data: [DONE]"
        refused = http.post("/v1/adapters", headers=ADMIN, json={"name": "again", "path": "broken"})
        assert refused.status_code == 422 and BROKEN in refused.json()["error"]["message"]
        assert [m["id"] for m in http.get("/v1/models").json()["data"]] == ["base", "good"]
        base = http.post("/v1/classify", json={"model": "base", "input": "i am happy", "labels": ["joy", "anger"]})
        assert base.status_code == 200, base.text  # the base model, adapters disabled, still answers


def test_predict_exits_2_naming_the_weights_and_writes_nothing(runs, tmp_path, capsys):
    assert main(["predict", str(runs / "broken"), "i am happy", "so sad"]) == 2
    out = capsys.readouterr()
    assert out.out == "" and f"{SAYS} for texts 1, 2" in out.err and BROKEN in out.err
    (tmp_path / "in.csv").write_text("text\ni am happy\n", encoding="utf-8")
    (tmp_path / "out.csv").write_text("an earlier,good file\n", encoding="utf-8")
    assert main(["predict", str(runs / "broken"), "--file", str(tmp_path / "in.csv"), "--out",
                 str(tmp_path / "out.csv")]) == 2
    assert "in.csv: row 1" in capsys.readouterr().err
    assert (tmp_path / "out.csv").read_text(encoding="utf-8") == "an earlier,good file\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.csv", "out.csv"]
    assert main(["predict", str(runs / "chat"), "hi"]) == 2  # greedy replies of padding before
    out = capsys.readouterr()
    assert out.out == "" and f"{SAYS} for the next token of a reply" in out.err


def test_an_overflow_with_finite_weights_is_blamed_on_the_dtype():
    fp16 = not_finite_message("The model `x`", "input[0]", torch.float16, weights=[])
    assert "weights are all finite" in fp16 and "bfloat16 or float32" in fp16
    assert "float16" not in not_finite_message("The model `x`", "input[0]", torch.float32, weights=None)


def test_the_studio_refuses_to_try_a_model_whose_weights_hold_nan(runs):
    from emotune.core.rundir import RunDir
    from emotune.studio.tryout import Refused, Tryout

    tryout = Tryout(training=lambda: None, device="cpu")
    with pytest.raises(Refused, match=re.escape(SAYS)) as refused:
        tryout.classify(RunDir(runs / "broken"), "i am happy")
    assert refused.value.status == 422 and tryout.engine is None


# --------------------------------------------------------------------------------------------------
# Measurements (`emotune eval`, `emotune run`'s baseline and fine-tuned stages): exit 2 naming the weights, no results
# written; scikit-learn failed with "Input contains NaN" and `generate` scored replies of padding before


GOOD = '{"method": "generate", "accuracy": 0.5}'


def _eval_refused(capsys, args: list[str], folder) -> str:
    """`emotune eval ARGS` exits 2 and leaves `folder`'s earlier metrics.json as it was; its message."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "metrics.json").write_text(GOOD, encoding="utf-8")
    assert main(["eval", *args]) == 2
    assert (folder / "metrics.json").read_text(encoding="utf-8") == GOOD
    assert not (folder / "predictions.csv").exists()
    return capsys.readouterr().err


@pytest.mark.parametrize("method", ["both", "score"])
def test_eval_of_an_adapter_whose_weights_hold_nan_exits_2_and_writes_nothing(runs, tiny_overrides, method, capsys):
    # eval.merge_adapters=always: not merged all the same, or the NaN would spread into the base weights it names
    err = _eval_refused(capsys, [*tiny_overrides, f"adapter={runs / 'broken'}", f"eval.method={method}",
                                 "eval.merge_adapters=always"], runs / "broken" / "eval" / "test-finetuned")
    # generate (the first of `both`) stops at the first batch of rows, score names every row; batches are sorted by
    # the prompt's length in tokens since generate reads the token ids scoring reads (by characters before: 2, 4, 6, 7, 10)
    rows = "1, 2, 3, 4, 5" if method == "both" else "1, 2, 3, 4, 5 and 7 more"
    assert f"{SAYS} for rows {rows} of the test split" in err and BROKEN in err and "base_layer" not in err
    assert "The test evaluation stopped and wrote no results." in err and "Traceback" not in err


def test_eval_of_a_head_adapter_whose_weights_hold_nan_exits_2(tiny_model_dir, tiny_overrides, tmp_path, capsys):
    run = poison(write_tiny_adapter(tiny_model_dir, tmp_path / "head", task="classify_head"))
    err = _eval_refused(capsys, ["task=classify_head", *tiny_overrides, f"adapter={run}"],
                        run / "eval" / "test-finetuned")
    assert SAYS in err and BROKEN in err and "of the test split" in err


def test_sft_eval_refuses_a_nan_loss_generation_and_probe(runs, tiny_model_dir, tmp_path, monkeypatch, capsys):
    from emotune.tasks.sft import eval as sft_eval

    rows = [{"instruction": f"{a} {b}", "output": b} for a in ("today", "my", "friend", "work", "morning")
            for b in ("joy", "love", "anger", "fear")]
    (tmp_path / "sft.jsonl").write_text("\n".join(json.dumps(r) for r in rows), encoding="utf-8")
    args = ["task=sft", f"model.source={tiny_model_dir}", f"data.source={tmp_path / 'sft.jsonl'}", "eval.probe=false",
            f"output_dir={tmp_path / 'runs'}", "eval.batch_size=4", f"adapter={runs / 'chat'}"]
    folder = runs / "chat" / "eval" / "test-finetuned"
    err = _eval_refused(capsys, args, folder)
    assert f"{SAYS} for the reference answers of rows 1, 2" in err and "(one batch's loss)" in err and BROKEN in err
    monkeypatch.setattr(sft_eval, "response_loss", lambda *args: (1.0, 10))  # as if only generation overflowed
    assert f"{SAYS} for the replies to rows 1, 2" in _eval_refused(capsys, args, folder)
    monkeypatch.setattr(sft_eval, "generate_texts", lambda model, tokenizer, prompts, *rest: ["joy"] * len(prompts))
    err = _eval_refused(capsys, [*args[:-1], "eval.probe=true", "eval.probe_limit=2", args[-1]], folder)
    assert f"{SAYS} for questions 1, 2 of the forgetting probe" in err


def test_run_on_a_base_model_whose_weights_hold_nan_stops_at_its_baseline(tiny_model_dir, tiny_overrides, tmp_path,
                                                                           capsys):
    import shutil

    base = shutil.copytree(tiny_model_dir, tmp_path / "broken-base")
    weights = load_file(base / "model.safetensors")
    weights[next(k for k in sorted(weights) if "down_proj" in k)].fill_(float("nan"))
    save_file(weights, base / "model.safetensors")
    assert main(["run", *tiny_overrides, f"model.source={base}"]) == 2
    err = capsys.readouterr().err
    assert SAYS in err and "mlp.down_proj.weight" in err and "The baseline evaluation stopped" in err
    run = tmp_path / "runs" / "tiny"
    assert not (run / "baseline" / "metrics.json").exists() and not (run / "adapter").exists()
    assert json.loads((run / "run.json").read_text())["stages"]["baseline"]["status"] == "failed"


def test_the_studio_refuses_to_try_an_adapter_that_does_not_fit_its_base(runs, tmp_path):
    """An adapter whose LoRA weights have another shape than the base's layers (trained on another base) is refused
    with serve's 422 message, not the studio's generic error."""
    import shutil

    from emotune.core.rundir import RunDir
    from emotune.studio.tryout import Refused, Tryout

    misfit = shutil.copytree(runs / "good", tmp_path / "misfit")
    path = misfit / "adapter" / "adapter_model.safetensors"
    weights = load_file(path)
    first = next(k for k in sorted(weights) if "lora_A" in k)
    weights[first] = weights[first][:, :-1].contiguous()
    save_file(weights, path)
    tryout = Tryout(training=lambda: None, device="cpu")
    with pytest.raises(Refused) as refused:
        tryout.classify(RunDir(misfit), "i am happy")
    assert refused.value.status == 422 and "shape" in str(refused.value) and tryout.engine is None
