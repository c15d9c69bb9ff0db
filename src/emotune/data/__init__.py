"""Labelled data: read → validate → clean → split → limit → balance → format as prompt-completion rows.

Every split comes out as a `datasets.Dataset` with two string columns, `text` and `label`; the label
set is fixed here once and shared by the prompt, training and both evaluations.

    sources.py   where rows come from (files, folders, save_to_disk, hub snapshots)
    read.py      one file -> Arrow table, or an error naming the file and line
    labels.py    label names and mapping (ids, ClassLabel, aliases)
    clean.py     Arrow-kernel cleaning steps
    splits.py    stratified splits, limits, balancing
    load.py      `load_data`: the steps in order, validation, the report
    prepare.py   `emotune data` and the prepared-data folder `run_dir/data/` that `emotune run` reuses
    (the prompt format used by training and evaluation is emotune.model.prompt, re-exported here)
"""

from emotune.data.load import LabeledData, load_data
from emotune.data.sources import EMBEDDED_LABELS, SPLITS, embedded_dataset_dir
from emotune.model.prompt import prompt_messages, system_prompt, to_prompt_completion

__all__ = ["EMBEDDED_LABELS", "SPLITS", "LabeledData", "embedded_dataset_dir", "load_data", "prompt_messages",
           "system_prompt", "to_prompt_completion"]
