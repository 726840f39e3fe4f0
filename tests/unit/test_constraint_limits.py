"""The bounds on user-supplied constraints: each limit refuses what passes it and names it, what real clients
send passes (pydantic models of several levels, recursive models, the regexes and grammars people write), and
generated structures of any shape are measured without recursion and against an independent count."""

from __future__ import annotations

import json
from enum import StrEnum
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from tokenmill.constraint_limits import (
    ConstraintLimits,
    ConstraintTooLarge,
    check_choices,
    check_grammar,
    check_regex,
    check_schema,
    longest_path,
    parse_schema,
)


class Color(StrEnum):
    RED = "red"
    BLUE = "blue"


class Leaf(BaseModel):
    name: str
    color: Color


class Tree(BaseModel):
    value: int
    children: list[Tree] = []
    leaf: Leaf | None = None


class Order(BaseModel):
    id: int
    items: list[Leaf]
    tree: Tree
    note: str | None = None


def test_what_clients_send_passes() -> None:
    for model in (Leaf, Tree, Order):
        check_schema(model.model_json_schema())
    for pattern in (r"\d{1,3}(\.\d{1,3}){3}", r"[A-Z][a-z]{2,20}( [A-Z][a-z]{2,20}){0,3}", r"(\w+@\w+\.com)?",
                    r"[\[\](){}]{1,5}", r"\{\d{4}\}"):  # fmt: skip
        check_regex(pattern)
    check_grammar(
        'start: expr\nexpr: term (("+" | "-") term)*\nterm: NUMBER | "(" expr ")"\nNUMBER: /[0-9]{1,9}/\n'
    )
    check_grammar('start: call\ncall: %json {"type": "object", "properties": {"a": {"type": "string"}}}\n')
    check_choices(["yes", "no", "maybe"])


def ref_chain(n: int) -> dict[str, Any]:
    defs: dict[str, Any] = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n)}
    defs[f"d{n}"] = {"type": "string"}
    return {"$ref": "#/$defs/d0", "$defs": defs}


def test_the_resolved_depth_follows_refs() -> None:
    limits = ConstraintLimits(max_resolved_depth=50)
    check_schema(ref_chain(40), limits)
    with pytest.raises(ConstraintTooLarge, match="through nesting and \\$ref, over the limit of 50"):
        check_schema(ref_chain(60), limits)


def test_a_cycle_counts_all_of_its_members() -> None:
    ring = {f"d{i}": {"anyOf": [{"type": "null"}, {"$ref": f"#/$defs/d{(i + 1) % 30}"}]} for i in range(30)}
    schema = {"$ref": "#/$defs/d0", "$defs": ring}
    check_schema(schema, ConstraintLimits(max_resolved_depth=200))
    with pytest.raises(ConstraintTooLarge, match="reach"):
        check_schema(schema, ConstraintLimits(max_resolved_depth=60))
    check_schema({"type": "object", "properties": {"next": {"$ref": "#"}}})  # a self-reference is one cycle


@pytest.mark.parametrize(
    "schema,limits,message",
    [
        (
            {"properties": {f"p{i}": {} for i in range(11)}},
            ConstraintLimits(max_properties=10),
            "11 properties",
        ),
        ({"enum": list(range(11))}, ConstraintLimits(max_enum_values=10), "11 enum values"),
        ({"$defs": {f"d{i}": {} for i in range(11)}}, ConstraintLimits(max_definitions=10), "11 definitions"),
        ({"description": "x" * 200}, ConstraintLimits(max_schema_bytes=100), "over the limit of 100"),
        ({"items": {"items": {"items": {}}}}, ConstraintLimits(max_schema_nesting=3), "nested more than 3"),
    ],
)
def test_each_schema_limit_names_itself(
    schema: dict[str, Any], limits: ConstraintLimits, message: str
) -> None:
    with pytest.raises(ConstraintTooLarge, match=message):
        check_schema(schema, limits)


def test_a_schema_string_nested_past_the_decoder_is_refused_not_a_recursion_error() -> None:
    with pytest.raises(ConstraintTooLarge, match="nested more than"):
        parse_schema("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ValueError, match="not valid JSON"):
        parse_schema("{")


@pytest.mark.parametrize(
    "pattern,message",
    [
        ("((a{100}){100}){100}", "repeats 1000000 times"),
        ("(a{10}|b{20000})", "repeats 20000 times"),
        ("x{3,}" * 1 + "(y{5000}){3}", "repeats 15000 times"),
        ("(" * 70 + "a" + ")" * 70, "nests groups 70 deep"),
        ("a" * 70_000, "70000 characters"),
    ],
)
def test_each_regex_limit_names_itself(pattern: str, message: str) -> None:
    with pytest.raises(ConstraintTooLarge, match=message):
        check_regex(pattern)


def test_counts_inside_character_classes_and_escapes_are_not_repetitions() -> None:
    check_regex(r"[{]100000[}]\{100000\}")


def lark_chain(n: int) -> str:
    return "start: r0\n" + "\n".join(f'r{i}: "a" r{i + 1}' for i in range(n)) + f'\nr{n}: "b"\n'


def test_grammar_limits() -> None:
    check_grammar(lark_chain(100), ConstraintLimits(max_rule_chain=200))
    with pytest.raises(ConstraintTooLarge, match="refer to each other 5002 deep"):
        check_grammar(lark_chain(5_000))
    with pytest.raises(ConstraintTooLarge, match="rules, over the limit of 50"):
        check_grammar(
            "start: a\n" + "\n".join(f'x{i}: "x"' for i in range(60)), ConstraintLimits(max_grammar_rules=50)
        )
    with pytest.raises(ConstraintTooLarge, match="nests groups 100 deep"):
        check_grammar("start: " + "(" * 100 + '"a"' + ")" * 100)
    with pytest.raises(ConstraintTooLarge, match="repeats 1000000 times"):
        check_grammar('start: (("a" ~ 100) ~ 100) ~ 100')
    with pytest.raises(ConstraintTooLarge, match="a regex of the grammar's rule start"):
        check_grammar("start: /((a{100}){100}){100}/")
    with pytest.raises(ConstraintTooLarge, match="through nesting and \\$ref"):
        check_grammar("start: %json " + json.dumps(ref_chain(2_000)))
    check_grammar('start: "((((((" /[(]{3}/ "~ 99999"')  # text inside strings and classes is not structure


def test_choices() -> None:
    with pytest.raises(ConstraintTooLarge, match="100000 entries"):
        check_choices([f"c{i}" for i in range(100_000)])
    with pytest.raises(ConstraintTooLarge, match="characters"):
        check_choices(["x" * 600_000, "y" * 600_000])


def _reference_longest(edges: list[list[int]]) -> int:
    """Brute force over simple paths, for small graphs; each strongly connected component counts its size."""
    n = len(edges)
    reach = [{v} for v in range(n)]
    changed = True
    while changed:
        changed = False
        for v in range(n):
            for w in list(reach[v]):
                new = set().union(*(reach[x] for x in edges[w])) - reach[v] if edges[w] else set()
                if new:
                    reach[v] |= new
                    changed = True
    comp = {v: frozenset(w for w in reach[v] if v in reach[w]) for v in range(n)}
    comps = set(comp.values())
    succ = {c: {comp[w] for v in c for w in edges[v]} - {c} for c in comps}
    memo: dict[frozenset[int], int] = {}

    def best(c: frozenset[int]) -> int:
        if c not in memo:
            memo[c] = len(c) + max((best(d) for d in succ[c]), default=0)
        return memo[c]

    return max((best(c) for c in comps), default=0)


@settings(max_examples=200, deadline=None)
@given(
    st.integers(0, 9).flatmap(
        lambda n: st.lists(st.lists(st.integers(0, max(n - 1, 0)), max_size=3), min_size=n, max_size=n)
    )
)
def test_longest_path_against_a_brute_force_count(edges: list[list[int]]) -> None:
    assert longest_path(edges) == _reference_longest(edges)


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=4),
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(
        st.sampled_from(["$ref", "properties", "items", "anyOf", "$defs", "a", "b", "enum"]), kids, max_size=4),
    max_leaves=40,
)  # fmt: skip


@settings(max_examples=200, deadline=None)
@given(JSON, st.integers(1, 300))
def test_any_structure_is_measured_or_refused_never_crashes(value: Any, depth: int) -> None:
    nested: Any = value
    for _ in range(depth):
        nested = {"properties": {"a": nested}}
    for check in (check_schema, lambda v: check_grammar("start: %json " + json.dumps(v))):
        try:
            check(nested)
        except ConstraintTooLarge as exc:
            assert "limit" in str(exc) or "nested more than" in str(exc)
        except ValueError as exc:  # a %json body that is not a schema
            assert "JSON" in str(exc)
