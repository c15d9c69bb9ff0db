"""The forgetting check: a general-ability multiple-choice probe answered before and after fine-tuning.

Each question is asked through the tokenizer's chat template and nothing is generated, so no answer is ever
invalid. Two ways of scoring (`score_probe(method=...)`):
- "option" (default): the question alone is asked, and each option is scored by the mean per-token
  log-likelihood of its own text as the model's reply (length-normalised); the best-scoring option is the answer.
- "letter": the options are listed as `A. …` to `D. …` and the answer is the letter the model finds most
  likely as the first token of its reply. Small models put little probability on the letters at all.
`compare_probe` flags a drop whose paired 95% interval lies below 0.
The questions are packaged in `datasets/probe/probe.jsonl` (see the DATASHEET beside it).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from emotune.core.errors import raise_problems
from emotune.eval.stats import bootstrap_ci, paired_bootstrap_delta
from emotune.runtime.oom import run_in_batches

PROBE_PATH = Path(__file__).parents[1] / "datasets" / "probe" / "probe.jsonl"  # emotune/datasets, one folder up
LETTERS = ("A", "B", "C", "D")
INSTRUCTIONS = {
    "en": "Answer with the letter of the correct option (A, B, C or D) only.",
    "zh": "请只回答正确选项的字母（A、B、C 或 D）。",
}
METHODS = ("option", "letter")
FIELDS = {"id": str, "lang": str, "topic": str, "question": str, "choices": list, "answer": int}


@dataclass(frozen=True)
class ProbeQuestion:
    """One multiple-choice question; `answer` is the index of the correct option in `choices`."""

    id: str
    lang: str
    topic: str
    question: str
    choices: tuple[str, ...]
    answer: int


def _row_problems(row: object) -> list[str]:
    """What is wrong with one parsed row, each problem naming its field."""
    if not isinstance(row, dict):
        return [f"is a JSON {type(row).__name__}, not an object with fields {', '.join(FIELDS)}"]
    problems = [f"field '{k}' is missing" for k in FIELDS if k not in row]
    for key, kind in FIELDS.items():
        if key in row and (not isinstance(row[key], kind) or isinstance(row[key], bool)):
            problems.append(f"field '{key}' must be a {kind.__name__}, not {type(row[key]).__name__}")
    if isinstance(row.get("lang"), str) and row["lang"] not in INSTRUCTIONS:
        problems.append(f"field 'lang' is '{row['lang']}'; it must be one of {', '.join(INSTRUCTIONS)}")
    choices = row.get("choices")
    if isinstance(choices, list) and (len(choices) != len(LETTERS)
                                      or not all(isinstance(c, str) and c.strip() for c in choices)):
        problems.append(f"field 'choices' must hold {len(LETTERS)} non-empty strings")
    answer = row.get("answer")
    if isinstance(answer, int) and not isinstance(answer, bool) and not 0 <= answer < len(LETTERS):
        problems.append(f"field 'answer' is {answer}; it must be an index 0–{len(LETTERS) - 1} into 'choices'")
    return problems


def _stratified(questions: list[ProbeQuestion], limit: int) -> list[ProbeQuestion]:
    """`limit` questions, each language's share proportional to its size (largest remainder), taken evenly
    spaced through that language's rows so that every topic block is sampled; file order kept."""
    by_lang: dict[str, list[int]] = {}
    for i, q in enumerate(questions):
        by_lang.setdefault(q.lang, []).append(i)
    exact = {lang: limit * len(idx) / len(questions) for lang, idx in by_lang.items()}
    quota = {lang: int(share) for lang, share in exact.items()}
    for lang in sorted(exact, key=lambda g: (quota[g] - exact[g], g))[: limit - sum(quota.values())]:
        quota[lang] += 1
    keep = {idx[j * len(idx) // quota[lang]] for lang, idx in by_lang.items() for j in range(quota[lang])}
    return [q for i, q in enumerate(questions) if i in keep]


def load_probe(path: Path | None = None, limit: int | None = None) -> list[ProbeQuestion]:
    """The probe's questions from a JSON-lines file (default: the packaged 280-question probe).

    `limit` keeps a deterministic subset of that many questions, stratified by language. A malformed file
    raises one UserError listing every bad line and field."""
    path = Path(path) if path is not None else PROBE_PATH
    problems, questions = [], []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            problems.append(f"line {number} is not valid JSON ({err.msg} at column {err.colno})")
            continue
        found = _row_problems(row)
        problems += [f"line {number}: {p}" for p in found]
        if not found:
            questions.append(ProbeQuestion(row["id"], row["lang"], row["topic"], row["question"],
                                           tuple(row["choices"]), row["answer"]))
    if not problems and not questions:
        problems.append("it holds no questions")
    raise_problems(f"The probe file {path}", problems, "Fix those lines, or point the probe at another file.")
    if limit is not None and limit < 1:
        raise_problems("The probe limit", [f"it is {limit}; it must be at least 1 (or unset for all questions)"])
    return questions if limit is None or limit >= len(questions) else _stratified(questions, limit)


def render_prompt(tokenizer, question: ProbeQuestion, method: str = "letter") -> str:
    """The chat-templated prompt text (generation prompt included) that asks one question: for "letter" with
    its options listed as `A. …` to `D. …` and an instruction to answer with the letter (the default, as before
    `method` existed); for "option" the question text alone."""
    if method == "option":
        content = question.question
    else:
        options = "\n".join(f"{letter}. {choice}" for letter, choice in zip(LETTERS, question.choices, strict=False))
        content = f"{question.question}\n\n{options}\n\n{INSTRUCTIONS[question.lang]}"
    return tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                         add_generation_prompt=True)


def option_token_ids(tokenizer, prompt: str, choices: tuple[str, ...]) -> tuple[list[int], list[list[int]]]:
    """The prompt's token ids and each choice's tokens as they tokenize right after it.

    When a tokenizer merges a choice into the prompt's last token, the choice is tokenized alone. Raises a
    UserError when a choice has no tokens."""
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    options = []
    for choice in choices:
        full = tokenizer(prompt + choice, add_special_tokens=False)["input_ids"]
        if full[: len(prompt_ids)] == prompt_ids and len(full) > len(prompt_ids):
            options.append(full[len(prompt_ids):])
        else:
            options.append(tokenizer(choice, add_special_tokens=False)["input_ids"])
    empty = [c for c, ids in zip(choices, options, strict=False) if not ids]
    if empty:
        raise_problems("The tokenizer", [f"the option {c!r} tokenizes to no tokens" for c in empty])
    return prompt_ids, options


def letter_token_ids(tokenizer, prompt: str) -> list[int]:
    """The first token of each letter as it tokenizes right after `prompt`.

    When a tokenizer merges the letter into the prompt's last token, the letter's own first token is used.
    Raises a UserError when two letters share a token, since the probe could not tell them apart."""
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    ids = []
    for letter in LETTERS:
        full = tokenizer(prompt + letter, add_special_tokens=False)["input_ids"]
        if full[: len(prompt_ids)] == prompt_ids and len(full) > len(prompt_ids):
            ids.append(full[len(prompt_ids)])
        else:
            ids.append(tokenizer(letter, add_special_tokens=False)["input_ids"][0])
    if len(set(ids)) < len(ids):
        raise_problems("The tokenizer", [f"the option letters {', '.join(LETTERS)} tokenize to the token ids "
                                         f"{ids}, which are not all distinct"],
                       "The probe needs a tokenizer that has the letters A–D as tokens.")
    return ids


@dataclass(frozen=True)
class ProbeResult:
    """One model's answers to the probe. Intervals are 95% percentile-bootstrap intervals (`bootstrap_ci`,
    2000 resamples, seed 0) over questions; `per_lang` maps a language to `{n, accuracy, low, high}`.

    `option_scores` holds each question's four scores in option order, the answer being the highest: for
    method "option" the mean per-token log-likelihood of each option's text, for "letter" log P(letter) over
    the full vocabulary (also readable as `letter_logprobs`)."""

    ids: list[str]
    langs: list[str]
    predicted: list[int]  # index of the chosen option
    correct: list[bool]
    option_scores: list[list[float]]  # per question, one score per option (see above)
    accuracy: float
    ci: tuple[float, float]
    per_lang: dict[str, dict]
    method: str = "option"

    @property
    def letter_logprobs(self) -> list[list[float]]:
        """The per-question scores under their earlier name (log P(letter) when `method` is "letter")."""
        return self.option_scores

    @classmethod
    def from_scores(cls, questions: list[ProbeQuestion], option_scores: list[list[float]],
                    method: str = "option") -> ProbeResult:
        """The result for these questions given each one's option scores (argmax = the answer)."""
        predicted = [max(range(len(row)), key=row.__getitem__) for row in option_scores]
        correct = [p == q.answer for p, q in zip(predicted, questions, strict=False)]
        per_lang = {}
        for lang in sorted({q.lang for q in questions}):
            flags = [float(c) for c, q in zip(correct, questions, strict=False) if q.lang == lang]
            low, high = bootstrap_ci(flags)
            per_lang[lang] = {"n": len(flags), "accuracy": sum(flags) / len(flags), "low": low, "high": high}
        return cls(ids=[q.id for q in questions], langs=[q.lang for q in questions], predicted=predicted,
                   correct=correct, option_scores=option_scores,
                   accuracy=sum(correct) / len(correct) if correct else 0.0,
                   ci=bootstrap_ci([float(c) for c in correct]) if correct else (0.0, 0.0), per_lang=per_lang,
                   method=method)

    def summary(self) -> dict:
        """`{n, method, accuracy, low, high, per_lang}` for a report (no per-question lists)."""
        return {"n": len(self.correct), "method": self.method, "accuracy": self.accuracy, "low": self.ci[0],
                "high": self.ci[1], "per_lang": self.per_lang}


def _left_padded(batch: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, ...]:
    """Input ids, attention mask and position ids for left-padded rows; position ids count real tokens only,
    so padding leaves every row's outputs unchanged."""
    width = max(map(len, batch))
    input_ids = torch.tensor([[pad_id] * (width - len(ids)) + ids for ids in batch], device=device)
    mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in batch], device=device)
    return input_ids, mask, (mask.cumsum(dim=1) - 1).clamp(min=0)


def _letter_logprobs(model, batch: list[list[int]], letters: list[list[int]], pad_id: int) -> list[list[float]]:
    """One forward pass over left-padded prompts; log-softmax over the vocabulary at each prompt's last token,
    read at its letter tokens."""
    device = next(model.parameters()).device
    input_ids, mask, positions = _left_padded(batch, pad_id, device)
    logits = model(input_ids=input_ids, attention_mask=mask, position_ids=positions, logits_to_keep=1).logits
    logprobs = torch.log_softmax(logits[:, -1].float(), dim=-1)
    return logprobs.gather(1, torch.tensor(letters, device=device)).tolist()


def _option_loglik(model, prompts: list[list[int]], options: list[list[int]], pad_id: int) -> list[float]:
    """One forward pass over left-padded `prompt + option` rows; each row's mean log P(option token | before)
    over its option tokens. Rows end together, so only the last `longest option` positions are projected onto
    the vocabulary (`logits_to_keep`)."""
    device = next(model.parameters()).device
    input_ids, mask, positions = _left_padded([p + o for p, o in zip(prompts, options, strict=False)], pad_id, device)
    keep = max(map(len, options))
    # the logits at the last keep + 1 positions but the very last predict the last `keep` tokens
    logits = model(input_ids=input_ids, attention_mask=mask, position_ids=positions,
                   logits_to_keep=keep + 1).logits[:, :-1].float()
    logprobs = torch.log_softmax(logits, dim=-1).gather(2, input_ids[:, -keep:].unsqueeze(-1)).squeeze(-1)
    counts = torch.tensor([len(o) for o in options], device=device)
    in_option = torch.arange(keep, device=device).unsqueeze(0) >= (keep - counts).unsqueeze(1)
    return (torch.where(in_option, logprobs, 0.0).sum(dim=1) / counts).tolist()


def score_probe(model, tokenizer, questions: list[ProbeQuestion], batch_size: int = 16,
                method: str = "option") -> ProbeResult:
    """Ask the model every question and take its most likely option as its answer.

    method "option" (default): the question alone is asked through the chat template, and each option is
    scored by the mean per-token log-likelihood of its own text as the model's reply, i.e. the summed
    log-probabilities of its tokens divided by its token count (length-normalised, so a long option is not
    penalised for its length). Each (question, option) pair is one sequence; `batch_size` counts sequences.
    method "letter": the options are listed as `A. …` to `D. …` and each is scored by log P(its letter) as the
    first token of the reply, over the full vocabulary; `batch_size` counts questions.

    Batches are of similar-length sequences, left-padded, one forward pass each; out of memory halves the
    batch. The model is put in eval mode for the call and restored after."""
    if method not in METHODS:
        raise_problems("The probe method", [f"it is {method!r}; it must be one of {', '.join(METHODS)}"])
    prompts = [render_prompt(tokenizer, q, method) for q in questions]
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    scores: list[list[float]] = [[0.0] * len(q.choices) for q in questions]

    if method == "letter":
        letters = [letter_token_ids(tokenizer, p) for p in prompts]
        encoded = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
        order = sorted(range(len(questions)), key=lambda i: len(encoded[i]))

        def step(rows: list[int]) -> None:
            got = _letter_logprobs(model, [encoded[i] for i in rows], [letters[i] for i in rows], pad_id)
            for i, row in zip(rows, got, strict=False):
                scores[i] = row
    else:
        pairs = [option_token_ids(tokenizer, p, q.choices) for p, q in zip(prompts, questions, strict=False)]
        rows_of = [(i, j) for i, q in enumerate(questions) for j in range(len(q.choices))]
        length = [len(pairs[i][0]) + len(pairs[i][1][j]) for i, j in rows_of]
        order = sorted(range(len(rows_of)), key=length.__getitem__)

        def step(rows: list[int]) -> None:
            picked = [rows_of[r] for r in rows]
            got = _option_loglik(model, [pairs[i][0] for i, _ in picked], [pairs[i][1][j] for i, j in picked],
                                 pad_id)
            for (i, j), value in zip(picked, got, strict=False):
                scores[i][j] = value

    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            run_in_batches(order, batch_size, step)
    finally:
        model.train(was_training)
    return ProbeResult.from_scores(questions, scores, method)


def compare_probe(before: ProbeResult, after: ProbeResult, confidence: float = 0.95) -> dict:
    """Accuracy before and after fine-tuning on the same questions, and whether it clearly dropped.

    `delta` = after − before with a paired-bootstrap interval over questions (`paired_bootstrap_delta`,
    2000 resamples, seed 0), overall and per language; `flagged` is True when the overall interval lies
    entirely below zero (forgetting). Raises ValueError when the two results are not on the same questions
    or were scored by different methods."""
    if before.ids != after.ids:
        raise ValueError("compare_probe needs both results on the same questions in the same order.")
    if before.method != after.method:
        raise ValueError(f"compare_probe needs both results scored the same way, not by {before.method!r} "
                         f"and {after.method!r}.")

    def paired(keep: list[bool]) -> dict:
        b = [float(c) for c, k in zip(before.correct, keep, strict=False) if k]
        a = [float(c) for c, k in zip(after.correct, keep, strict=False) if k]
        delta = paired_bootstrap_delta(b, a, confidence=confidence)
        return {"n": len(b), "accuracy_before": sum(b) / len(b), "accuracy_after": sum(a) / len(a), **delta}

    out = {"method": before.method, **paired([True] * len(before.ids))}
    out["flagged"] = out["high"] < 0
    out["per_lang"] = {lang: paired([g == lang for g in before.langs]) for lang in sorted(set(before.langs))}
    return out
