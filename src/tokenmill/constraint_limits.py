"""Bounds on user-supplied constraints (JSON schemas, Lark grammars, regexes, choices), checked before any
library walks them. Torch-free, and iterative throughout: a structure of any depth is measured without
recursion.

Why: llguidance compiles a schema's ``$ref`` chain and a grammar's rule chain recursively in native code. On
an 8 MiB thread stack a chain of ~700 nested object definitions or ~2,500 chained Lark rules overflows it and
the process dies of SIGSEGV (llguidance 1.9, measured 2026-12-03). Every structure is measured here first and
refused with a 400 naming the limit; what passes is then compiled on a thread with a large stack
(``structured_outputs``), so the margin between these limits and a crash is more than tenfold.

The limits are far above what real clients send: OpenAI documents at most 5,000 properties, 10 levels of
nesting and 1,000 enum values for a strict schema; pydantic models of the agent frameworks nest a few levels.

What is measured:

- JSON schema: its serialized size, the nesting of its document, the number of definitions, properties and
  enum values, and the *resolved depth*: the deepest path of subschemas through both nesting and ``$ref``
  (a cycle counts as long as all of its members, since a compiler may walk the whole cycle before it
  closes).
- Lark grammar: size, number of rules, the longest chain of rules referring to rules (cycles counted as
  above), parentheses' nesting, and every ``%json`` schema and ``/regex/`` inside it.
- Regex: size, nesting of groups, and the product of counted repetitions along the nesting
  (``((a{100}){100}){100}`` asks for a million).
- choice: the number of alternatives and their total size.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any


class ConstraintTooLarge(ValueError):
    """A constraint past one of :class:`ConstraintLimits`; the message names the limit."""


@dataclass(frozen=True)
class ConstraintLimits:
    max_schema_bytes: int = 1 << 20
    max_schema_nesting: int = 64  # levels of the schema's JSON document
    max_resolved_depth: int = 1_000  # subschemas along the deepest path through nesting and $ref
    max_definitions: int = 5_000
    max_properties: int = 10_000
    max_enum_values: int = 10_000
    max_grammar_bytes: int = 1 << 20
    max_grammar_rules: int = 10_000
    max_rule_chain: int = 2_000
    max_grammar_nesting: int = 64  # parentheses and brackets inside one rule
    max_regex_bytes: int = 64 << 10
    max_regex_nesting: int = 64
    max_repetition: int = 10_000  # product of counted repetitions along a nesting
    max_choices: int = 10_000
    max_choice_bytes: int = 1 << 20


DEFAULT_LIMITS = ConstraintLimits()

_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def parse_schema(text: str, limits: ConstraintLimits = DEFAULT_LIMITS) -> Any:
    """A JSON schema given as a string, parsed: its size checked before, its nesting during (a
    RecursionError of the decoder is a ConstraintTooLarge, not a crash)."""
    if len(text) > limits.max_schema_bytes:
        raise ConstraintTooLarge(
            f"the JSON schema is {len(text)} bytes, over the limit of {limits.max_schema_bytes}"
        )
    try:
        return json.loads(text)
    except RecursionError:
        raise ConstraintTooLarge(
            f"the JSON schema is nested more than {limits.max_schema_nesting} levels deep"
        ) from None
    except ValueError as exc:
        raise ValueError(f"the JSON schema is not valid JSON: {exc}") from None


def check_schema(schema: Any, limits: ConstraintLimits = DEFAULT_LIMITS) -> None:
    """ConstraintTooLarge when ``schema`` (parsed JSON) passes a limit; else None."""
    _check_nesting(schema, limits.max_schema_nesting, "the JSON schema")
    size = len(json.dumps(schema, separators=(",", ":")))
    if size > limits.max_schema_bytes:
        raise ConstraintTooLarge(
            f"the JSON schema is {size} bytes, over the limit of {limits.max_schema_bytes}"
        )
    counts = {"definitions": 0, "properties": 0, "enum values": 0}
    for node in _dicts(schema):
        for key in ("$defs", "definitions"):
            if isinstance(node.get(key), dict):
                counts["definitions"] += len(node[key])
        if isinstance(node.get("properties"), dict):
            counts["properties"] += len(node["properties"])
        if isinstance(node.get("enum"), list):
            counts["enum values"] += len(node["enum"])
    for what, limit in (("definitions", limits.max_definitions), ("properties", limits.max_properties),
                        ("enum values", limits.max_enum_values)):  # fmt: skip
        if counts[what] > limit:
            raise ConstraintTooLarge(f"the JSON schema has {counts[what]} {what}, over the limit of {limit}")
    depth = _resolved_depth(schema)
    if depth > limits.max_resolved_depth:
        raise ConstraintTooLarge(
            f"the JSON schema's subschemas reach {depth} levels deep through nesting and $ref, over the limit "
            f"of {limits.max_resolved_depth}"
        )


def _check_nesting(value: Any, limit: int, what: str) -> None:
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > limit:
            raise ConstraintTooLarge(f"{what} is nested more than {limit} levels deep")
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else ()
        stack.extend((child, depth + 1) for child in children if isinstance(child, dict | list))


def _dicts(value: Any) -> Iterator[dict[str, Any]]:
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            yield item
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)


def _subschemas(node: dict[str, Any]) -> Iterator[Any]:
    """The values of ``node`` that hold schemas (maps' values, lists' items, single schemas)."""
    for key, value in node.items():
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            yield from value.values()
        elif isinstance(value, list):
            yield from value
        elif isinstance(value, dict):
            yield value


def _resolved_depth(schema: Any) -> int:
    """The longest path of subschemas, a ``$ref`` an edge to its target; each cycle counts its size."""
    if not isinstance(schema, dict):
        return 0
    ids: dict[int, int] = {}  # id(dict) -> node index
    nodes: list[dict[str, Any]] = []
    pointers: dict[str, int] = {}
    stack: list[tuple[Any, str]] = [(schema, "#")]
    while stack:
        item, pointer = stack.pop()
        if isinstance(item, dict):
            if id(item) in ids:
                continue
            ids[id(item)] = len(nodes)
            pointers[pointer] = len(nodes)
            nodes.append(item)
            stack.extend((v, f"{pointer}/{_escape(str(k))}") for k, v in item.items())
        elif isinstance(item, list):
            stack.extend((v, f"{pointer}/{i}") for i, v in enumerate(item))
    edges: list[list[int]] = [[] for _ in nodes]
    for index, node in enumerate(nodes):
        for child in _subschemas(node):
            if isinstance(child, dict) and id(child) in ids:
                edges[index].append(ids[id(child)])
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#"):
            target = pointers.get(ref.rstrip("/") or "#")
            if target is not None:
                edges[index].append(target)
    return longest_path(edges)


def _escape(key: str) -> str:
    return key.replace("~", "~0").replace("/", "~1")


def longest_path(edges: list[list[int]]) -> int:
    """Nodes on the longest path of the directed graph ``edges`` (node -> successors), a strongly connected
    component counted as all of its nodes. Iterative Tarjan, then the condensation in reverse topological
    order (Tarjan emits components sinks first)."""
    n = len(edges)
    index = [-1] * n
    low = [0] * n
    on_stack = [False] * n
    comp = [-1] * n
    comps: list[list[int]] = []
    stack: list[int] = []
    counter = 0
    for root in range(n):
        if index[root] >= 0:
            continue
        work = [(root, 0)]
        while work:
            v, i = work.pop()
            if i == 0:
                index[v] = low[v] = counter
                counter += 1
                stack.append(v)
                on_stack[v] = True
            if i < len(edges[v]):
                work.append((v, i + 1))
                w = edges[v][i]
                if index[w] < 0:
                    work.append((w, 0))
                elif on_stack[w]:
                    low[v] = min(low[v], index[w])
                continue
            if low[v] == index[v]:
                members = []
                while True:
                    w = stack.pop()
                    on_stack[w] = False
                    comp[w] = len(comps)
                    members.append(w)
                    if w == v:
                        break
                comps.append(members)
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[v])
    best = [0] * len(comps)
    for c, members in enumerate(comps):  # successors' components come earlier
        below = max((best[comp[w]] for v in members for w in edges[v] if comp[w] != c), default=0)
        best[c] = len(members) + below
    return max(best, default=0)


def check_regex(pattern: str, limits: ConstraintLimits = DEFAULT_LIMITS, what: str = "the regex") -> None:
    """ConstraintTooLarge when ``pattern`` passes the size, nesting or repetition limit."""
    if len(pattern) > limits.max_regex_bytes:
        raise ConstraintTooLarge(
            f"{what} is {len(pattern)} characters, over the limit of {limits.max_regex_bytes}"
        )
    _check_groups(pattern, True, limits.max_regex_nesting, limits.max_repetition, what)


def _check_groups(text: str, regex: bool, max_nesting: int, max_repetition: int, what: str) -> None:
    nesting, repetition = _group_measure(text, "(" if regex else "([", ")" if regex else ")]", regex)
    if nesting > max_nesting:
        raise ConstraintTooLarge(f"{what} nests groups {nesting} deep, over the limit of {max_nesting}")
    if repetition > max_repetition:
        raise ConstraintTooLarge(
            f"{what} repeats {repetition} times through nested counted repetitions, over the limit of "
            f"{max_repetition}"
        )


def _group_measure(text: str, opens: str, closes: str, regex: bool) -> tuple[int, int]:
    """(deepest group nesting, largest product of counted repetitions along a nesting). ``regex``: a
    pattern (escapes, character classes); otherwise a Lark expansion (strings and /regexes/ skipped)."""
    frames = [1]  # per open group: the largest repetition inside it so far
    deepest, i, n = 0, 0, len(text)
    last = 1  # the repetition of the atom just closed (a quantifier multiplies it)
    while i < n:
        c = text[i]
        if c == "\\":
            i, last = i + 2, 1
            frames[-1] = max(frames[-1], 1)
            continue
        if regex and c == "[":
            i, last = _skip_class(text, i), 1
            continue
        if not regex and c.isspace():  # Lark: "a" ~ 3 repeats "a"
            i += 1
            continue
        if not regex and c in '"/':
            i, last = _skip_quoted(text, i, c), 1
            continue
        if c in opens:
            frames.append(1)
            deepest = max(deepest, len(frames) - 1)
        elif c in closes and len(frames) > 1:
            last = frames.pop()
            frames[-1] = max(frames[-1], last)
            i += 1
            continue
        elif c == "{" or (not regex and c == "~"):
            count, i = _read_count(text, i)
            if count:
                last *= count
                frames[-1] = max(frames[-1], last)
                continue
        last = 1
        i += 1
    return deepest, max(frames)


def _read_count(text: str, i: int) -> tuple[int, int]:
    """At ``{m}``, ``{m,}``, ``{m,n}`` (regex) or ``~ m`` / ``~ m..n`` (Lark): (the largest count, the index
    after it); (0, i) when it is no count."""
    j, n = i + 1, len(text)
    while j < n and text[j] == " ":
        j += 1
    digits = []
    while j < n and (text[j].isdigit() or text[j] in ",. "):
        digits.append(text[j])
        j += 1
    if text[i] == "{":
        if j >= n or text[j] != "}":
            return 0, i
        j += 1
    numbers = [int(d) for d in "".join(digits).replace("..", ",").replace(" ", "").split(",") if d.isdigit()]
    if not numbers:
        return 0, i
    return max(max(numbers), 1), j


def _skip_class(text: str, i: int) -> int:
    """The index after the character class opening at ``text[i]`` (``[``)."""
    j, n = i + 1, len(text)
    if j < n and text[j] == "^":
        j += 1
    if j < n and text[j] == "]":
        j += 1
    depth = 1
    while j < n and depth:
        if text[j] == "\\":
            j += 2
            continue
        if text[j] == "[":
            depth += 1
        elif text[j] == "]":
            depth -= 1
        j += 1
    return j


def _skip_quoted(text: str, i: int, quote: str) -> int:
    j, n = i + 1, len(text)
    while j < n and text[j] != quote and text[j] != "\n":
        j += 2 if text[j] == "\\" else 1
    return j + 1


def check_choices(choices: list[str], limits: ConstraintLimits = DEFAULT_LIMITS) -> None:
    if len(choices) > limits.max_choices:
        raise ConstraintTooLarge(f"choice has {len(choices)} entries, over the limit of {limits.max_choices}")
    size = sum(len(c) for c in choices)
    if size > limits.max_choice_bytes:
        raise ConstraintTooLarge(
            f"choice's entries add up to {size} characters, over the limit of {limits.max_choice_bytes}"
        )


_RULE_START = re.compile(r"[?!]?([A-Za-z_][A-Za-z_0-9]*)(?:\.-?\d+)?\s*:")
_NAME = re.compile(r"[A-Za-z_][A-Za-z_0-9]*")


def check_grammar(grammar: str, limits: ConstraintLimits = DEFAULT_LIMITS) -> None:
    """ConstraintTooLarge when the Lark ``grammar`` passes a limit: its size, rules, the chain of rules,
    nesting and repetition inside a rule, or any ``%json`` schema or ``/regex/`` it holds."""
    if len(grammar) > limits.max_grammar_bytes:
        raise ConstraintTooLarge(
            f"the grammar is {len(grammar)} characters, over the limit of {limits.max_grammar_bytes}"
        )
    text = _without_json_blocks(grammar, limits)
    rules: dict[str, list[str]] = {}  # rule -> the lines of its body
    current: list[str] | None = None
    for line in text.splitlines():
        stripped = line.strip()
        match = _RULE_START.match(stripped)
        if match and not stripped.startswith("%"):
            current = rules.setdefault(match.group(1), [])
            current.append(stripped[match.end() :])
        elif current is not None and stripped and not stripped.startswith(("%", "//")):
            current.append(stripped)
    if len(rules) > limits.max_grammar_rules:
        raise ConstraintTooLarge(
            f"the grammar has {len(rules)} rules, over the limit of {limits.max_grammar_rules}"
        )
    names = list(rules)
    number = {name: i for i, name in enumerate(names)}
    edges: list[list[int]] = [[] for _ in names]
    for name, lines in rules.items():
        body = "\n".join(lines)
        _check_groups(
            body, False, limits.max_grammar_nesting, limits.max_repetition, f"the grammar's rule {name}"
        )
        for kind, token in _lark_tokens(body):
            if kind == "regex":
                check_regex(token, limits, what=f"a regex of the grammar's rule {name}")
            elif kind == "name" and token in number:
                edges[number[name]].append(number[token])
    chain = longest_path(edges)
    if chain > limits.max_rule_chain:
        raise ConstraintTooLarge(
            f"the grammar's rules refer to each other {chain} deep, over the limit of {limits.max_rule_chain}"
        )


def _lark_tokens(body: str) -> Iterator[tuple[str, str]]:
    """("name", identifier) and ("regex", pattern) in a rule's body, strings and comments passed over."""
    i, n = 0, len(body)
    while i < n:
        c = body[i]
        if c == '"':
            i = _skip_quoted(body, i, '"')
        elif c == "/" and body.startswith("//", i):
            end = body.find("\n", i)
            i = n if end < 0 else end
        elif c == "/":
            end = _skip_quoted(body, i, "/")
            yield "regex", body[i + 1 : end - 1]
            i = end
        elif c.isalpha() or c == "_":
            match = _NAME.match(body, i)
            assert match is not None
            yield "name", match.group(0)
            i = match.end()
        else:
            i += 1


def _without_json_blocks(grammar: str, limits: ConstraintLimits) -> str:
    """``grammar`` with each ``%json {...}`` body checked as a schema and cut out."""
    out: list[str] = []
    start = 0
    while True:
        at = grammar.find("%json", start)
        if at < 0:
            out.append(grammar[start:])
            return "".join(out)
        brace = grammar.find("{", at)
        if brace < 0:
            out.append(grammar[start:])
            return "".join(out)
        end = _json_object_end(grammar, brace)
        check_schema(parse_schema(grammar[brace:end], limits), limits)
        out.append(grammar[start:at] + "JSON_SCHEMA")
        start = end


def _json_object_end(text: str, i: int) -> int:
    """The index after the JSON object that opens at ``text[i]``."""
    depth, j, n = 0, i, len(text)
    while j < n:
        c = text[j]
        if c == '"':
            j += 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
        elif c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return j + 1
        j += 1
    return n
