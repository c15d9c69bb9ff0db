"""An Axolotl config's `datasets:` entry and chat template, as emotune's `data` and `model.chat_template`.

Axolotl reads `path` as a local file or folder when it exists, else as a Hugging Face hub dataset (its `split`,
default `train`); `type` says how rows become text: `alpaca` (instruction/input/output, in Axolotl's Alpaca prompt),
`chat_template` (a list of turns under field_messages, rendered with a chat template), the older `sharegpt`.
Where the defaults come from (axolotl-ai-cloud/axolotl, `src/axolotl/utils/schemas/`): datasets.py (SFTDataset)
and utils.py (handle_legacy_message_fields_logic: role and content default to `role` and `content`).
"""

from __future__ import annotations

import difflib
import re
from pathlib import Path
from typing import Any

from emotune.core.config.sft import INPUT_SEPARATOR
from emotune.core.config.translation import NEAR_MISS, Translation, name_list, show

FIRST = "datasets[0]"
# the files of rows a hub dataset id never ends in
LOCAL_SUFFIXES = (".json", ".jsonl", ".csv", ".tsv", ".parquet", ".arrow", ".txt")
REMOTE = ("s3://", "gs://", "gcs://", "az://", "abfs://", "oci://", "http://", "https://")
# Axolotl's default `roles` (SFTDataset.roles): each side and the role names it accepts
DEFAULT_ROLES = {"user": ["human", "user"], "assistant": ["gpt", "assistant"], "system": ["system"], "tool": ["tool"]}
SIDE_TAGS = {"user": "user_tag", "assistant": "assistant_tag", "system": "system_tag", "tool": "observation_tag"}
# keys of a dataset entry that make Axolotl read other rows, or other text, than emotune would: their harmless value
DATASET_REFUSED: dict[str, tuple[Any, str]] = {
    "name": (None, "a hub dataset's configuration; emotune reads the dataset's files: give the configuration's folder "
                   "as data.source in an emotune config"),
    "shards": (None, "emotune reads the whole dataset; remove shards"),
    "input_transform": (None, "emotune reads the rows as they are; remove input_transform"),
    "field": (None, "it is for `type: completion` text, which emotune does not train on"),
    "drop_system_message": (False, "emotune keeps each row's system turn; remove drop_system_message"),
    "message_field_training_detail": (None, "emotune trains whole assistant turns, not character spans"),
    "split_thinking": (False, "emotune refuses reasoning traces in the rows; remove split_thinking"),
    "field_thinking": (None, "emotune refuses reasoning traces in the rows; remove field_thinking"),
    "logprobs_field": (None, "emotune trains on answers, not on a teacher's log-probabilities"),
}
# the keys of a dataset entry this module reads
DATASET_READ = ("path", "type", "data_files", "revision", "split", "field_messages", "message_property_mappings",
                "message_field_role", "message_field_content", "roles", "roles_to_train", "train_on_eos",
                "message_field_training", "chat_template", "chat_template_jinja")
# Axolotl's user-defined prompt (`type:` given as a mapping) and its defaults (UserDefinedDatasetConfig)
USER_DEFINED = {"system_prompt": "", "field_system": "system", "field_instruction": "instruction",
                "field_input": "input", "field_output": "output", "format": "{instruction} {input} ",
                "no_input_format": "{instruction} ", "system_format": "{system}"}
DATASET_IGNORED = {"ds_type": "emotune reads a file by its ending (.json, .jsonl, .parquet, .csv)",
                   "trust_remote_code": "emotune reads data files and never runs a dataset's code",
                   "preprocess_shards": "a memory setting of Axolotl's; it does not change the rows"}


def dataset(t: Translation) -> None:
    """`datasets`: one entry, its source and its row format."""
    entries = t.settings["datasets"]
    if not isinstance(entries, list) or not entries:
        t.problems.append("`datasets` is missing; name the data to train on, e.g. datasets: [{path: "
                          "tatsu-lab/alpaca, type: alpaca}]")
        return
    if len(entries) > 1:
        t.problems.append(f"`datasets` lists {len(entries)} datasets; emotune reads one data source: put the rows in "
                          "one file of one type (or a folder of train/validation/test files) and name it once")
    entry = entries[0]
    if isinstance(entry, dict):
        _misspelt_keys(t, entry)
    if not isinstance(entry, dict) or not entry.get("path"):
        t.problems.append("`datasets[0]` has no `path`; give the local file or folder, or the hub dataset's id")
        return
    for key, value in entry.items():  # so each entry key prints in the table as datasets[0].KEY
        t.settings[f"{FIRST}.{key}"] = value
        t.given.add(f"{FIRST}.{key}")
    _source(t, entry)
    _format(t, entry)
    for key, (harmless, why) in DATASET_REFUSED.items():
        if entry.get(key, harmless) not in (None, False, harmless):
            t.problems.append(f"`{FIRST}.{key}: {show(entry[key])}` is not supported: {why}")
    t.ignored += [(f"{FIRST}.{key}", why) for key, why in DATASET_IGNORED.items() if key in entry]


def _misspelt_keys(t: Translation, entry: dict[str, Any]) -> None:
    """A near miss of a dataset key (`feild_messages`, `message_property_mapping`) is a problem, as at the top level:
    the setting it meant would be left at its default, and the rows read another way. Any other key emotune does not
    read is listed as ignored, as at the top level (it was left out of the printed translation, unsaid)."""
    known = [*DATASET_READ, *DATASET_REFUSED, *DATASET_IGNORED]
    for key in entry:
        if key in known:
            continue
        close = difflib.get_close_matches(str(key), known, n=1, cutoff=NEAR_MISS)
        if close:
            t.problems.append(f"`{FIRST}.{key}` is not an Axolotl dataset key; did you mean `{close[0]}`?")
        else:
            t.ignored.append((f"{FIRST}.{key}", "not a dataset key emotune translates"))


def _local_looking(path: str) -> bool:
    """A path no hub dataset id can be: Axolotl tries a missing local path on the hub, which fails on the name."""
    return (path.startswith(("/", "./", "../", "~", ".\\")) or "\\" in path or path.count("/") > 1
            or Path(path).suffix.lower() in LOCAL_SUFFIXES)


def _source(t: Translation, entry: dict[str, Any]) -> None:
    path = str(entry["path"])
    files = name_list(entry["data_files"]) if entry.get("data_files") else []
    if path.startswith(REMOTE):
        t.problems.append(f"`{FIRST}.path: {path}` is not supported: emotune reads local files and Hugging Face hub "
                          "datasets; download it and give the local path")
    elif len(files) > 1:
        t.problems.append(f"`{FIRST}.data_files` lists {len(files)} files; emotune reads one file, or a folder of "
                          "train/validation/test files: give that folder as the path")
    elif files:
        local = next((p for p in (Path(path) / files[0], Path(files[0])) if p.expanduser().is_file()), None)
        if local is None:
            t.problems.append(f"`{FIRST}.data_files: {files[0]}` is not a local file; emotune reads a hub dataset's "
                              "files as a whole: give the file's local path")
        else:
            t.set("data.source", str(local), f"{FIRST}.path", f"{FIRST}.data_files")
    elif Path(path).expanduser().exists():
        t.set("data.source", path, f"{FIRST}.path", note="a local file or folder")
    elif path.startswith("file:"):
        t.problems.append(f"`{FIRST}.path: {path}` is not supported: give the file's plain path, without file://")
    elif _local_looking(path):
        t.problems.append(f"`{FIRST}.path: {path}` is not a file or folder here (a relative path is read from the "
                          f"folder emotune runs in, {Path.cwd()}, as Axolotl reads it) and cannot be a hub dataset's "
                          "id (owner/name): fix the path")
    else:
        t.set("data.source", f"hf:{path}", f"{FIRST}.path",
              note="not a local path, so a Hugging Face hub dataset, as Axolotl reads it")
    if entry.get("revision"):
        t.set("data.revision", str(entry["revision"]), f"{FIRST}.revision")
    split = entry.get("split")
    if isinstance(split, str) and split.replace(" ", "").startswith("train["):  # a slice: train[:10%]
        t.problems.append(f"`{FIRST}.split: {split}` is not supported: emotune reads the whole train split, not a "
                          "slice of it; remove split, and to train on fewer rows set data.train_limit=N (a seeded "
                          "sample of N rows, not the first rows the slice takes)")
    elif split not in (None, "train"):
        t.problems.append(f"`{FIRST}.split: {split}` is not supported: emotune trains on the source's train split "
                          "(validation and test splits, where the source has them, are held out as such); remove "
                          "split")


def _format(t: Translation, entry: dict[str, Any]) -> None:
    kind = entry.get("type")
    if kind == "alpaca":
        t.set("data.format", "alpaca", f"{FIRST}.type")
        t.set("data.input_separator", INPUT_SEPARATOR, f"{FIRST}.type",
              note="a blank line between instruction and input, as in Axolotl's Alpaca prompt")
        t.notes.append("type: alpaca: emotune renders each row with the model's chat template, not Axolotl's Alpaca "
                       "prompt (\"Below is an instruction ... ### Instruction: ... ### Response:\"), so the model "
                       "learns the turn format it will be served with.")
    elif kind == "sharegpt":
        t.set("data.format", "sharegpt", f"{FIRST}.type", note="conversations of from/value turns, human and gpt")
    elif kind == "chat_template":
        _chat_turns(t, entry)
        chat_template(t, entry.get("chat_template"), entry.get("chat_template_jinja"), f"{FIRST}.")
    elif isinstance(kind, dict):
        _user_defined(t, kind)
    elif kind in ("completion", "pretraining"):
        t.problems.append(f"`{FIRST}.type: {kind}` is not supported: plain text (pretraining-style, the loss on every "
                          "token) is not something emotune trains on; give instructions (type: alpaca) or "
                          "conversations (type: chat_template)")
    else:
        t.problems.append(f"`{FIRST}.type: {show(kind)}` is not supported: emotune reads type alpaca, chat_template "
                          "and sharegpt rows (its own prompt formats, and Axolotl's others, are not emotune's)")


def _user_defined(t: Translation, spec: dict[str, Any]) -> None:
    """`type:` as a mapping, Axolotl's user-defined prompt (prompt_strategies/user_defined.py): instruction, input,
    output and system columns under other names, and prompt strings around them. emotune reads the columns as an
    Alpaca row's, with the system prompt for rows without one, and renders the turns with the chat template; the
    text between {instruction} and {input} in `format` is what joins them."""
    where = f"{FIRST}.type"
    unknown = [key for key in spec if key not in USER_DEFINED]
    if unknown:
        t.problems.append(f"`{where}` names {', '.join(f'`{k}`' for k in unknown)}, which Axolotl's user-defined prompt "
                          f"does not read (it reads {', '.join(USER_DEFINED)}); fix the key")
    fields = {**USER_DEFINED, **{k: v for k, v in spec.items() if v is not None}}
    bad = [key for key, value in fields.items() if not isinstance(value, str) or (key.startswith("field_") and
                                                                                   key != "field_input" and not value)]
    if bad:
        t.problems.append(f"`{where}.{bad[0]}: {show(fields[bad[0]])}` must be text (a column name for field_ keys); "
                          "fix the value")
        return
    t.set("data.format", "alpaca", where, note="Axolotl's user-defined prompt: an instruction, input and output "
                                               "column each")
    for column, key in (("prompt", "field_instruction"), ("query", "field_input"), ("response", "field_output"),
                        ("system", "field_system")):
        if fields[key]:
            t.set(f"data.columns.{column}", fields[key], f"{where}.{key}")
    if fields["system_prompt"]:
        t.set("prompt.system_prompt", fields["system_prompt"], f"{where}.system_prompt",
              note="for rows without a system column")
    form = fields["format"]
    start, end = form.find("{instruction}"), form.find("{input}")
    if start < 0 or (end >= 0 and end < start):
        t.problems.append(f"`{where}.format: {show(form)}` does not put {{instruction}} before {{input}}, which is "
                          "how emotune joins an Alpaca row's two parts; give format as \"{instruction} {input}\" "
                          "(or swap field_instruction and field_input)")
    elif end >= 0:
        separator = form[start + len("{instruction}"):end]
        if separator:
            t.set("data.input_separator", separator, f"{where}.format",
                  note="the text between {instruction} and {input}")
    if any(fields[key] != USER_DEFINED[key] for key in ("format", "no_input_format", "system_format")):
        t.notes.append(f"{where}: emotune renders each row with the model's chat template, not the prompt strings of "
                       "format, no_input_format and system_format (their text around the columns is left out), so "
                       "the model learns the turn format it will be served with.")


def _chat_turns(t: Translation, entry: dict[str, Any]) -> None:
    """`type: chat_template`: the turns' column and keys, and which role names are which side."""
    mappings = entry.get("message_property_mappings") or {}
    if not isinstance(mappings, dict):
        t.problems.append(f"`{FIRST}.message_property_mappings: {show(mappings)}` is not supported: give the turn "
                          "keys as a mapping, e.g. {role: from, content: value}")
        mappings = {}
    field = str(entry.get("field_messages") or "messages")
    role = str(mappings.get("role") or entry.get("message_field_role") or "role")
    content = str(mappings.get("content") or entry.get("message_field_content") or "content")
    roles = entry.get("roles")
    keys = [f"{FIRST}.{k}" for k in ("field_messages", "message_property_mappings", "roles") if k in entry]
    if (field, role, content, roles) == ("messages", "role", "content", None):
        t.set("data.format", "messages", f"{FIRST}.type", note="OpenAI role/content turns under `messages`")
    else:
        t.set("data.format", "sharegpt", f"{FIRST}.type", *keys, note="turns with the keys and role names below")
        t.set("data.columns.messages", field, f"{FIRST}.field_messages")
        t.set("data.tags.role_tag", role, f"{FIRST}.message_property_mappings")
        t.set("data.tags.content_tag", content, f"{FIRST}.message_property_mappings")
        sides = roles if isinstance(roles, dict) else {side: [n for n in names if (n in ("human", "gpt")) == (role == "from")]
                                                      for side, names in DEFAULT_ROLES.items()}
        for side, tag in SIDE_TAGS.items():
            accepted = name_list(sides.get(side) or DEFAULT_ROLES[side])
            t.set(f"data.tags.{tag}", accepted[0], f"{FIRST}.roles")
            if len(accepted) > 1:
                t.notes.append(f"roles.{side} lists {', '.join(accepted)}: emotune reads one role name per side, the "
                               f"first ({accepted[0]}); a turn with another is reported when the data is read.")
    trained = entry.get("roles_to_train")
    if trained not in (None, ["assistant"], "assistant"):
        t.problems.append(f"`{FIRST}.roles_to_train: {show(trained)}` is not supported: emotune's loss is on the "
                          "assistant turns; remove roles_to_train")
    if entry.get("train_on_eos") not in (None, "turn"):
        t.problems.append(f"`{FIRST}.train_on_eos: {entry['train_on_eos']}` is not supported: emotune trains the end "
                          "of each trained assistant turn (train_on_eos: turn); remove train_on_eos")
    if entry.get("message_field_training") not in (None, "training", "train"):
        t.problems.append(f"`{FIRST}.message_field_training: {entry['message_field_training']}` is not supported: "
                          "emotune reads a turn's `training` (or `train`) flag; rename the key in the rows")


def chat_template(t: Translation, name: Any, jinja: Any, where: str = "") -> None:
    """Axolotl's chat_template: the tokenizer's own is emotune's too; a Jinja file is model.chat_template; Axolotl's
    named templates (chatml, llama3, ...) are refused, since emotune renders with the model's template."""
    if name in (None, "tokenizer_default") and not jinja:
        return
    if isinstance(name, str) and name.startswith("tokenizer_default_fallback_"):
        t.notes.append(f"{where}chat_template: {name}: emotune uses the tokenizer's chat template too; where the "
                       "tokenizer has none it writes Gemma's turn format, not the fallback.")
    elif name in (None, "jinja") and jinja:
        file = Path(str(jinja)).expanduser()
        if "\n" not in str(jinja) and file.is_file():
            t.set("model.chat_template", str(jinja), f"{where}chat_template_jinja")
        elif not any(mark in str(jinja) for mark in ("{{", "{%", "\n")):  # a path, not a template
            t.problems.append(f"`{where}chat_template_jinja: {jinja}`: no such file (a relative path is read from the "
                              f"folder emotune runs in, {Path.cwd()}); fix the path")
        else:
            t.problems.append(f"`{where}chat_template_jinja` is not supported as template text: write the template "
                              "to a .jinja file and give its path")
    elif _family_template(name, t.settings.get("base_model")):
        t.notes.append(f"{where}chat_template: {name}: the template of {t.settings['base_model']}'s own family, which "
                       "emotune renders with the model's own tokenizer template (Axolotl's copy of it).")
    else:
        t.problems.append(f"`{where}chat_template: {show(name)}` is not supported: it is Axolotl's own template, and "
                          "emotune renders turns with the model's chat template (a family's own template, such as "
                          "gemma3 for a Gemma 3 base_model, is taken as that); use chat_template: tokenizer_default, "
                          "or give the template as a Jinja file (chat_template: jinja, chat_template_jinja: FILE)")


# Axolotl's named templates that are a model family's own chat template, and how that family's hub ids read once
# lower-cased with everything but letters and digits removed (google/gemma-3-270m-it: googlegemma3270mit).
FAMILY_TEMPLATES = {"gemma": ("gemma2", "gemma7b", "gemma2b"), "gemma3": ("gemma3",), "gemma3n": ("gemma3n",),
                    "gemma4": ("gemma4",), "llama3": ("llama3",), "llama4": ("llama4",), "qwen_25": ("qwen25",),
                    "qwen3": ("qwen3",), "qwen3_5": ("qwen35",), "phi_3": ("phi3",), "phi_35": ("phi35",), "phi_4": ("phi4",)}


def _family_template(name: Any, base_model: Any) -> bool:
    """Whether Axolotl's template `name` is the own template of the family `base_model` names (a hub id or a folder
    named after it): emotune's rendering with the model's own template is then the same."""
    model = re.sub(r"[^a-z0-9]", "", str(base_model or "").lower())
    return any(family in model for family in FAMILY_TEMPLATES.get(str(name), ()))
