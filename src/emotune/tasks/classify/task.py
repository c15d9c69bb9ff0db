"""`task: classify`: generative classification, the label name as the assistant's answer.

Rows are (text, label); the prompt is the system prompt (with the label names) and the user template;
the loss is on the label's tokens and the end of the turn; the measurement is `eval.method` (decoding
with a regex, and/or exact label scoring) with accuracy, macro-F1, per-class scores, invalid outputs
and confusion matrices, the same before and after training.
"""

from __future__ import annotations

from pathlib import Path

from datasets import Dataset
from transformers import PreTrainedTokenizerBase

from emotune.core.config.data import PromptConfig
from emotune.core.config.run import ClassifyConfig
from emotune.core.errors import UserError
from emotune.core.replies import extract_label, label_pattern
from emotune.core.rundir import RunDir, read_json
from emotune.data import LabeledData, system_prompt
from emotune.data.clean import text_steps
from emotune.data.prepare import data_fingerprint, format_summary, prepare_data, save_prepared, saved_fingerprint
from emotune.eval.evaluate import (
    EvalResult,
    LabelPrompt,
    auto_batch_cap,
    eval_methods,
    evaluate_methods,
    method_folder,
    read_evaluation,
    write_results,
)
from emotune.eval.scoring import answer_token_ids, prompt_token_ids
from emotune.model.artifacts import Artifact, Fallback, check_matches, find_artifact, trained_outputs
from emotune.model.turns import answer_end
from emotune.tasks.classify.report import baseline_notes, compare_methods, format_table, measurements, report_sections, write_comparison
from emotune.train.batches import LANGUAGE_MODEL, Example, Objective

__all__ = ["COMPARED_METRICS", "CONFIG", "DEFAULT_METRIC", "MEASUREMENT", "SHOWN_METRICS", "SWEEP_COLUMNS",
           "adapter_meta", "compare", "data_fingerprint", "describe_data", "encode_examples", "evaluate",
           "find_adapter", "format_comparison", "has_results", "load_adapted", "load_data", "measurements",
           "memory_workload", "merge_check_inputs", "outputs", "read_results", "report_sections", "run_info",
           "save_data", "saved_fingerprint", "training_rows", "training_setup", "write_comparison", "write_results"]

# What `emotune plan` assumes where the config does not say: a label of up to 3 tokens plus the end of the turn,
# and as many labels as the packaged emotion dataset has.
LABEL_TOKENS = 4
ASSUMED_LABELS = 6

CONFIG = ClassifyConfig  # the config class of this task (emotune.core.config.build.TASK_CONFIGS)
SHOWN_METRICS = ("accuracy", "macro_f1", "weighted_f1", "invalid", "top2_accuracy", "log_loss", "ece")  # `emotune eval`
COMPARED_METRICS = ("accuracy", "macro_f1", "weighted_f1", "invalid", "top2_accuracy", "log_loss", "ece")  # in comparison.json
DEFAULT_METRIC = "macro_f1"  # what a sweep ranks by
SWEEP_COLUMNS = ("macro_f1", "accuracy")  # shown in sweep tables
MEASUREMENT = "classification"  # `emotune compare` puts it beside other classifiers


# --------------------------------------------------------------------------------------------------
# Data


def load_data(cfg: ClassifyConfig) -> LabeledData:
    """Validated, cleaned and split data (or the run folder's prepared copy of the same data)."""
    return prepare_data(cfg)


def save_data(data: LabeledData, run: RunDir, tokenizer, cfg: ClassifyConfig) -> None:
    check_labels_tell_apart(tokenizer, data.labels)
    if cfg.eval.method != "score":
        check_labels_spelled_back(tokenizer, data.labels)
    check_room_for_the_label(tokenizer, cfg.prompt, data.labels, cfg.train.max_length)
    save_prepared(data, run, tokenizer, cfg)


def check_room_for_the_label(tokenizer, prompt: PromptConfig, labels: list[str], max_length: int) -> None:
    """A prompt (system prompt with every label name, the user template) longer than train.max_length before any text
    cuts every row's label: training would run on no answer token at all and report the base model as trained."""
    if tokenizer.chat_template is None:  # `emotune data` reads the tokenizer alone; the run checks its rows
        return
    end = answer_end(tokenizer)  # one rendering of the template, not one per label
    prompt_ids = prompt_token_ids(tokenizer, prompt, labels, [""])[0]
    needed = len(prompt_ids) + max(map(len, answer_token_ids(tokenizer, prompt, labels,
                                                             [label + end for label in labels])))
    if needed > max_length:
        raise UserError(f"The prompt and a label take {needed} tokens before any text (the system prompt names all "
                        f"{len(labels)} labels), more than train.max_length={max_length}: every row would lose its "
                        f"label and training would learn nothing. Raise train.max_length (e.g. "
                        f"train.max_length={needed + 128}) or shorten prompt.system_prompt.")


def check_labels_tell_apart(tokenizer, labels: list[str]) -> None:
    """Labels the model would answer with the same tokens can be neither learned nor measured apart: a tokenizer
    without byte fallback reads characters it lacks (an emoji, another script) as its unknown token, so `😱` and `喜び`
    are both `<unk>`; training would teach one answer for both and scoring would tie them, without a word."""
    groups: dict[tuple[int, ...], list[str]] = {}
    for label in labels:  # alone, not in the chat template: `emotune data` reads the tokenizer without one
        groups.setdefault(tuple(tokenizer(label, add_special_tokens=False)["input_ids"]), []).append(label)
    same = [names for names in groups.values() if len(names) > 1]
    if same:
        listed = "; ".join(", ".join(map(repr, names)) for names in same)
        raise UserError(f"The labels {listed} are the same tokens to this model's tokenizer (characters it does not "
                        "know read as its unknown token), so no training or scoring could tell them apart. Rename them "
                        "with data.label_aliases (e.g. data.label_aliases={'😱': fear}) or use a model whose tokenizer "
                        "covers them.")


def check_labels_spelled_back(tokenizer, labels: list[str]) -> None:
    """A tokenizer whose normalizer rewrites text (NFKC folds `Ｊｏｙ` to `Joy` and `ﬁne` to `fine`; T5's and ALBERT's
    normalizers drop characters) can never write such a label back: the `generate` method reads replies for the
    label's own text (case aside: emotune.core.replies), so the label would be invalid in every reply while `score` picks it."""
    normalizer = getattr(getattr(tokenizer, "backend_tokenizer", None), "normalizer", None)
    if normalizer is None:
        return

    def read_back(label: str) -> str:
        return tokenizer.decode(tokenizer(label, add_special_tokens=False)["input_ids"], skip_special_tokens=True)

    pattern = label_pattern(labels)
    lost = [label for label in labels if extract_label(read_back(label), labels, pattern) != label]
    if lost:
        spelled = ", ".join(f"{label!r} reads back as {read_back(label)!r}" for label in lost)
        raise UserError(f"This model's tokenizer rewrites the labels it reads ({spelled}), so the model can never write "
                        "them and eval.method=generate would count every such answer invalid. Rename them with "
                        "data.label_aliases to the text the tokenizer keeps, or measure with eval.method=score.")


def describe_data(data: LabeledData) -> str:
    return format_summary(data)


def run_info(cfg: ClassifyConfig, data: LabeledData) -> dict:
    return {"labels": data.labels, "rows": {name: len(ds) for name, ds in data.splits.items()},
            "system_prompt": system_prompt(cfg.prompt, data.labels)}


# --------------------------------------------------------------------------------------------------
# Training rows: the prompt, then the label as the assistant's turn; the loss on the label's tokens


def training_rows(data: LabeledData, tokenizer: PreTrainedTokenizerBase, cfg: ClassifyConfig
                  ) -> tuple[list[Example], list[Example]]:
    max_length = cfg.train.max_length
    train = encode_examples(data.splits["train"], tokenizer, cfg.prompt, data.labels, max_length,
                            class_weights=data.class_weights)  # set only by data.balance=class_weight
    return train, encode_examples(data.splits["validation"], tokenizer, cfg.prompt, data.labels, max_length)


def encode_examples(ds: Dataset, tokenizer: PreTrainedTokenizerBase, prompt: PromptConfig, labels: list[str],
                    max_length: int, class_weights: dict[str, float] | None = None) -> list[Example]:
    """Each row is the scoring prompt (system prompt, user turn and generation prompt: the very tokens label scoring and
    generation read) followed by the label and the template's closing of an answer (emotune.model.turns.answer_end),
    the loss on those; rows are cut at `max_length`. The finished conversation's own rendering is not used: templates
    render an answer differently from the prompt that asks for it (Gemma 4's generation prompt opens and closes an
    empty thought channel, Qwen3 writes an empty <think> block into the last answer, Mistral v0.3 puts the system
    prompt into the last user turn only), and training on that rendering would teach a prompt the model never sees."""
    end = answer_end(tokenizer)  # one rendering of the template, not one per label
    answers = sorted(set(ds["label"]))
    completions = dict(zip(answers, answer_token_ids(tokenizer, prompt, labels,
                                                     [a + end for a in answers]), strict=True))
    examples = []
    prompts = prompt_token_ids(tokenizer, prompt, labels, ds["text"]) if len(ds) else []
    for prompt_ids, label in zip(prompts, ds["label"], strict=True):
        full_ids = list(prompt_ids) + completions[label]
        weight = class_weights[label] if class_weights else 1.0
        examples.append(Example(full_ids[:max_length], min(len(prompt_ids), max_length), weight))
    cut = sum(e.completion_tokens == 0 for e in examples)
    if examples and cut == len(examples):
        raise UserError(f"Every one of the {cut} rows lost its label to train.max_length={max_length}, so training would "
                        "learn nothing; raise train.max_length (or shorten the prompt).")
    if cut:
        print(f"Warning: {cut} of {len(examples)} rows lost their label to train.max_length={max_length} and teach "
              "nothing; raise train.max_length.", flush=True)
    return examples


def adapter_meta(cfg: ClassifyConfig, data: LabeledData) -> dict:
    """What emotune.json records, so the adapter is measured and served with its training prompt and labels."""
    return {"task": "classify", "labels": data.labels, "system_prompt": system_prompt(cfg.prompt, data.labels),
            "system_prompt_template": cfg.prompt.system_prompt, "user_template": cfg.prompt.user_template,
            "base_model": cfg.model.source, "eval": cfg.eval.model_dump(), "cleaning": text_steps(cfg.data.cleaning),
            "max_length": cfg.train.max_length,  # predict warns about texts longer than the run trained on
            "text_column": cfg.data.text_column}  # predict --file's default column


# --------------------------------------------------------------------------------------------------
# Measurement and comparison


def evaluate(model, tokenizer, data: LabeledData, cfg: ClassifyConfig, desc: str) -> dict:
    """Every method of `eval.method` on `eval.split`: {method: EvalResult}."""
    split = data.splits[cfg.eval.split]
    return evaluate_methods(model, tokenizer, split, LabelPrompt(cfg.prompt, data.labels), cfg.eval, desc=desc)


def merge_check_inputs(tokenizer: PreTrainedTokenizerBase, data: LabeledData, cfg: ClassifyConfig, rows: int
                       ) -> list[list[int]]:
    """The first `rows` evaluated prompts as token ids, as both methods read them (chat template, generation prompt)."""
    split = data.splits[cfg.eval.split]
    texts = split.select(range(min(rows, len(split))))["text"]
    return prompt_token_ids(tokenizer, cfg.prompt, data.labels, texts)


def read_results(folder: Path, cfg: ClassifyConfig) -> dict[str, EvalResult] | None:
    """{method: EvalResult} (metrics and predictions) when every method's results are complete in `folder`, else None."""
    return read_evaluation(folder, eval_methods(cfg.eval))


def has_results(folder: Path) -> bool:
    """Whether `folder` holds a measurement (the first method's metrics.json, readable), for `emotune report`."""
    return read_json(folder / "metrics.json") is not None


def find_adapter(path: str, cfg: ClassifyConfig, data: LabeledData) -> Artifact:
    """The adapter `emotune eval adapter=PATH` measures; one from another tool gets this config's labels and prompt,
    an emotune one must have been trained with them."""
    artifact = find_artifact(path, fallback=Fallback(labels=data.labels, prompt=cfg.prompt, base_model=None,
                                                     source="the config"))
    if artifact.task != "classify":
        raise UserError(f"`{artifact.path}` is a {artifact.task} adapter; `task: classify` measures generative "
                        "classification adapters. Use that adapter's own config (its run folder's config.yaml).")
    check_matches(artifact, data.labels, system_prompt(cfg.prompt, data.labels))
    return artifact


def compare(before: dict[str, EvalResult], after: dict[str, EvalResult], data: LabeledData) -> dict:
    return compare_methods(before, after, data.labels)


def format_comparison(comparison: dict, data: LabeledData, cfg: ClassifyConfig) -> str:
    chance = comparison.get("chance")  # absent from comparisons written before chance levels existed
    tables = [f"\nBefore/after on the {cfg.eval.split} split ({one['rows']} rows, method {method}):\n"
              + format_table(one, data.labels, chance) for method, one in comparison["methods"].items()]
    if chance:
        baseline = {m: {"rows": one["rows"], "invalid": one["metrics"]["invalid"]["before"]}
                    for m, one in comparison["methods"].items()}
        tables += ["", *baseline_notes(baseline, chance)]
    return "\n".join(tables)


def outputs(run: RunDir, cfg: ClassifyConfig) -> list[Path]:
    """What a finished classification run holds."""
    methods = eval_methods(cfg.eval)
    results = [method_folder(stage, m, methods) / name for stage in (run.baseline, run.finetuned) for m in methods
               for name in ("metrics.json", "predictions.csv")]
    return [*results, *trained_outputs(run, cfg.train.finetuning), run.comparison_json,
            run.comparison_csv, run.report_html]


# --------------------------------------------------------------------------------------------------
# The model trained and measured: the causal LM itself, with CAUSAL_LM adapters and the completion loss


def training_setup(model, cfg, data) -> tuple[object, Objective]:
    return model, LANGUAGE_MODEL


def load_adapted(model, adapter_dir: Path, cfg, data):
    from peft import PeftModel

    return PeftModel.from_pretrained(model, adapter_dir)


def memory_workload(cfg: ClassifyConfig, device_type: str):
    """What `emotune plan` models: the loss on the label tokens of each row; `generate` decodes
    `eval.max_new_tokens` after the prompt with the model's KV cache, `score` projects the end of the prompt and
    every label-tree node with a cache that keeps every token. Prompts are taken as `train.max_length` long."""
    from emotune.train.memory import Evaluation, Workload

    labels = len(cfg.data.label_names or []) or ASSUMED_LABELS
    evaluations = {}
    for method in eval_methods(cfg.eval):
        auto = cfg.eval.batch_size == "auto"
        rows = auto_batch_cap(method, device_type) if auto else cfg.eval.batch_size
        evaluations[method] = (
            Evaluation(rows, auto, cfg.train.max_length, cfg.eval.max_new_tokens, projected=1, cache="model")
            if method == "generate" else
            Evaluation(rows, auto, cfg.train.max_length + LABEL_TOKENS * labels, projected=labels + 1, cache="full"))
    return Workload(loss_tokens_per_row=LABEL_TOKENS, evaluations=evaluations)
