"""A small renderer for the part of Go's text/template that emotune's Ollama templates use, to check them
against the model's chat template without Ollama.

Covered, with Go's semantics: text; `{{ expr }}` output; trim markers `{{-` and `-}}` (all whitespace on that side);
`range PIPELINE` (dot becomes each element); `if` / `else if` / `else` / `end` (false, 0, "" and empty lists are
false); variables declared with `:=` (scoped to their block) and assigned with `=`; `.Field`, `$.Field`, `$var`;
string, integer and boolean literals; the functions eq, and, or, not, len. Anything else raises ValueError, so a template
that needs more than this fails its test instead of being rendered wrongly.
"""

from __future__ import annotations

import re

TOKEN = re.compile(r"\{\{(-\s)?(.*?)(\s-)?\}\}", re.S)


def _lex(template: str) -> list[tuple[str, str]]:
    """[("text", ...), ("action", ...)] with trim markers applied to the neighbouring text."""
    parts: list[tuple[str, str]] = []
    position = 0
    trim_next = False
    for match in TOKEN.finditer(template):
        text = template[position:match.start()]
        if trim_next:
            text = text.lstrip()
        if match.group(1):
            text = text.rstrip()
        parts.append(("text", text))
        parts.append(("action", match.group(2).strip()))
        trim_next = bool(match.group(3))
        position = match.end()
    tail = template[position:]
    parts.append(("text", tail.lstrip() if trim_next else tail))
    return parts


def _parse(parts: list[tuple[str, str]], start: int, stops: tuple[str, ...]) -> tuple[list, int, str | None]:
    """Nodes until an action starting with one of `stops`; returns (nodes, index after it, that action)."""
    nodes: list = []
    i = start
    while i < len(parts):
        kind, value = parts[i]
        i += 1
        if kind == "text":
            if value:
                nodes.append(("text", value))
            continue
        keyword = value.split(" ", 1)[0]
        if keyword in stops:
            return nodes, i, value
        if keyword in ("range", "if"):
            node, i = _parse_block(parts, i, keyword, value[len(keyword):].strip())
            nodes.append(node)
        elif keyword in ("end", "else"):
            raise ValueError(f"unexpected {{{{ {value} }}}}")
        else:
            nodes.append(("action", value))
    if stops:
        raise ValueError(f"missing {{{{ end }}}} (expected one of {stops})")
    return nodes, i, None


def _parse_block(parts, i: int, keyword: str, condition: str) -> tuple[tuple, int]:
    branches = []
    while True:
        body, i, stop = _parse(parts, i, ("end", "else"))
        branches.append((condition, body))
        if stop == "end":
            return (keyword, branches), i
        rest = stop[len("else"):].strip()
        if keyword == "range" or (rest and not rest.startswith("if ")):
            raise ValueError(f"unsupported {{{{ {stop} }}}}")
        condition = rest[len("if "):].strip() if rest else None


def render(template: str, data: dict) -> str:
    nodes, _, _ = _parse(_lex(template), 0, ())
    out: list[str] = []
    _run(nodes, data, [{"$": data}], out)
    return "".join(out)


def _run(nodes: list, dot, scopes: list[dict], out: list[str]) -> None:
    scopes = [*scopes, {}]
    for node in nodes:
        kind = node[0]
        if kind == "text":
            out.append(node[1])
        elif kind == "action":
            value = _action(node[1], dot, scopes)
            if value is not None:
                out.append(value if isinstance(value, str) else str(value).lower() if isinstance(value, bool) else str(value))
        elif kind == "range":
            condition, body = node[1][0]
            for item in _expr(condition, dot, scopes):
                _run(body, item, scopes, out)
        else:  # if / else if / else
            for condition, body in node[1]:
                if condition is None or _truthy(_expr(condition, dot, scopes)):
                    _run(body, dot, scopes, out)
                    break


def _action(text: str, dot, scopes: list[dict]):
    """Output of `{{ text }}`; declarations and assignments output nothing."""
    match = re.fullmatch(r"(\$\w+)\s*(:?=)\s*(.+)", text, re.S)
    if not match:
        return _expr(text, dot, scopes)
    name, op, expression = match.groups()
    value = _expr(expression, dot, scopes)
    if op == ":=":
        scopes[-1][name] = value
        return None
    for scope in reversed(scopes):
        if name in scope:
            scope[name] = value
            return None
    raise ValueError(f"assignment to undeclared variable {name}")


def _truthy(value) -> bool:
    return bool(value)


FUNCTIONS = {"eq": lambda a, b: a == b, "and": lambda *a: next((x for x in a if not x), a[-1]),
             "or": lambda *a: next((x for x in a if x), a[-1]), "not": lambda a: not a, "len": len}


def _expr(text: str, dot, scopes: list[dict]):
    text = text.strip()
    if text.startswith("(") and text.endswith(")"):
        return _expr(text[1:-1], dot, scopes)
    words = _split(text)
    if len(words) > 1:
        if words[0] not in FUNCTIONS:
            raise ValueError(f"unsupported function in {{{{ {text} }}}}")
        return FUNCTIONS[words[0]](*(_expr(w, dot, scopes) for w in words[1:]))
    return _operand(text, dot, scopes)


def _split(text: str) -> list[str]:
    """Words of a call, keeping quoted strings and parenthesised calls whole."""
    words, depth, current = [], 0, ""
    for piece in re.findall(r'"(?:\\.|[^"\\])*"|\(|\)|[^\s()]+', text):
        depth += piece == "("
        depth -= piece == ")"
        current = f"{current} {piece}" if current and piece != ")" and not current.endswith("(") else current + piece
        if depth == 0:
            words.append(current)
            current = ""
    return words


def _operand(text: str, dot, scopes: list[dict]):
    if text.startswith('"') and text.endswith('"'):
        return bytes(text[1:-1], "utf-8").decode("unicode_escape")
    if text in ("true", "false"):
        return text == "true"
    if re.fullmatch(r"-?\d+", text):
        return int(text)
    if text == ".":
        return dot
    if text.startswith("$"):
        name, _, fields = text.partition(".")
        for scope in reversed(scopes):
            if name in scope:
                return _fields(scope[name], fields)
        raise ValueError(f"undefined variable {name}")
    if text.startswith("."):
        return _fields(dot, text[1:])
    raise ValueError(f"unsupported operand {text!r}")


def _fields(value, path: str):
    for name in filter(None, path.split(".")):
        value = value[name] if isinstance(value, dict) else getattr(value, name)
    return value
