"""The one exception type that reaches the user as a message instead of a traceback."""


class UserError(Exception):
    """Bad input (config, data, request, environment): the message names the field and the fix.

    The CLI prints it as one paragraph and exits with status 2; nothing else is caught that way, so a
    real bug still shows its traceback.
    """


def first_line(err: BaseException) -> str:
    """A library exception's first line (at most 300 characters), to quote inside a UserError."""
    text = str(err).strip()
    return (text.splitlines()[0] if text else type(err).__name__)[:300]


def listed(numbers: list[int], shown: int = 5) -> str:
    """`3, 6, 9, 12, 15 and 7 more`: row or line numbers for a message, the first few shown and the rest counted."""
    head = ", ".join(map(str, numbers[:shown]))
    return head + (f" and {len(numbers) - shown} more" if len(numbers) > shown else "")


def raise_problems(subject: str, problems: list[str], fix: str = "") -> None:
    """Every problem found at once, as one UserError: `The data has 2 problems:` and one line each.

    The one formatter for "all problems at once" (config, data); nothing is raised when `problems` is empty."""
    if not problems:
        return
    lines = [p if p.endswith((".", "?", "!")) else p + "." for p in problems]
    head = f"{subject} has 1 problem:" if len(lines) == 1 else f"{subject} has {len(lines)} problems:"
    raise UserError("\n".join([head, *(f"  - {line}" for line in lines), *([fix] if fix else [])]))


def read_from(path: str) -> str:
    """Where a relative path that is not there was looked for: the folder emotune runs in, not the config file's
    (as LLaMA-Factory and Axolotl read theirs), said so that a run started from another folder is understood."""
    from pathlib import Path

    return "" if Path(path).expanduser().is_absolute() else f" (a relative path is read from the folder emotune runs in, {Path.cwd()})"
