"""Grammars a reply must match, made from what a request asks: a JSON schema, or tool calls in Gemma-4's format.

Each builder returns llguidance's serialized grammar (the value of the `grammar` generation setting), made from a
Lark grammar (llguidance's dialect): special tokens are written by id (`<[48]>`), JSON through `%json {schema}`.
sampling/constraint.py runs it over a canvas (docs/ARCHITECTURE.md, 'Constrained output').

A reply may open with the thought channel (`<|channel>` ... `<channel|>`) when thinking is on; text outside the
grammar's literals never contains a special token, because llguidance matches text lexemes against ordinary tokens
only.

Tool calls (tool_calls.py's grammar): `<|tool_call>call:NAME{key:value,...}<tool_call|>`, strings between `<|"|>`
delimiters, unquoted keys, numbers, true/false/null, lists and nested objects. A parameter schema maps to rules:
an object's declared properties in their declared order (required ones always, optional ones optional), its other
keys only when it declares no properties and does not forbid them; `enum`/`const` as literals; `anyOf`/`oneOf` and
type lists as alternatives; anything else as any value. A string never contains `<|`, so the parser cannot meet a
delimiter inside it. Every call these rules allow fits its schema, except where a schema uses a validation keyword
the rules do not enforce (`unenforced`: a pattern, a bound, a length, `$ref`, `oneOf`, ...); there the value is any
value of its type, and `tool_call_grammar(..., exact=True)` refuses the tools instead.
"""

from __future__ import annotations

import json

from .errors import InputError
from .tool_calls import CALL_CLOSE, CALL_OPEN, STR

THOUGHT_OPEN, THOUGHT_CLOSE = "<|channel>", "<channel|>"
_TEXT = r"/([^<]|<+[^<|])*<*/"  # no '<|' anywhere: no special-token lookalike
_INT = r"/-?(0|[1-9][0-9]*)/"
_NUMBER = r"/-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][-+]?[0-9]+)?/"
_KEY = r"/[A-Za-z_][A-Za-z0-9_.\-]*/"
# JSON as json.dumps writes it: no free whitespace, which a canvas would otherwise fill with blanks
JSON_LAYOUT = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}


def _llguidance():
    try:
        import llguidance
    except ImportError as e:  # a declared dependency; only a broken install lands here
        raise InputError("constrained output needs the llguidance package (pip install llguidance)") from e
    return llguidance


def from_lark(lark: str) -> str:
    """A Lark grammar (llguidance's dialect) -> the serialized grammar the `grammar` setting holds."""
    return _llguidance().LLMatcher.grammar_from_lark(lark)


def _token(token_id, text: str) -> str:
    tid = token_id(text)
    if tid is None:
        raise InputError(f"constrained output: the tokenizer has no {text!r} token")
    return f"<[{tid}]>"


def _thought(token_id, thinking: bool) -> str:
    if not thinking:
        return ""
    return f"thought: {_token(token_id, THOUGHT_OPEN)} {_TEXT} {_token(token_id, THOUGHT_CLOSE)}\n"


def json_grammar(schema: dict | None, token_id, *, thinking: bool = False) -> str:
    """The reply is one JSON value matching `schema` (None: any JSON object), after an optional thought."""
    schema = {"type": "object"} if schema is None else schema
    if not isinstance(schema, dict):
        raise InputError(f"response_format schema: expected a JSON object, got {type(schema).__name__}")
    schema = {**_closed(schema), "x-guidance": {**JSON_LAYOUT, **schema.get("x-guidance", {})}}
    start = "start: thought? value\n" if thinking else "start: value\n"
    lark = start + _thought(token_id, thinking) + f"value: %json {json.dumps(schema)}\n"
    return _compile(lark, "response_format schema")


# JSON-schema keywords llguidance does not implement; each only narrows what a schema allows
_NARROWING = frozenset({"not", "if", "then", "else", "uniqueItems", "contains", "minContains", "maxContains",
                        "dependentRequired", "dependentSchemas", "dependencies", "unevaluatedProperties",
                        "unevaluatedItems", "propertyNames", "format"})


def loosened(schema):
    """The schema without the keywords llguidance does not implement (`oneOf` read as `anyOf`): every value the
    schema allows, this one allows too (a grammar made from it steers a reply that is checked afterwards)."""
    if isinstance(schema, list):
        return [loosened(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for k, v in schema.items():
        if k in ("enum", "const", "default", "examples"):
            out[k] = v
        elif k == "properties" and isinstance(v, dict):
            out[k] = {name: loosened(sub) for name, sub in v.items()}
        elif k not in _NARROWING:
            out["anyOf" if k == "oneOf" else k] = loosened(v)
    return out


def _closed(schema):
    """The schema with `additionalProperties: false` on every object that declares properties and says nothing of
    others: each reply it allows is valid under the original, and a canvas is not invited to invent keys."""
    if isinstance(schema, list):
        return [_closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: (_closed(v) if k not in ("enum", "const", "default", "examples") else v) for k, v in schema.items()}
    if isinstance(schema.get("properties"), dict):
        out["properties"] = {k: _closed(v) for k, v in schema["properties"].items()}
        out.setdefault("additionalProperties", False)
    return out


def tool_call_grammar(tools: list[dict], token_id, *, name: str | None = None, text_before: bool = False,
                      thinking: bool = False, exact: bool = False, parallel: bool = True) -> str:
    """The reply is tool calls of the offered functions, arguments fitting their parameter schemas.

    name: only that function, called once (a named tool_choice); else one call or more of any offered function (one
    only when not `parallel`).
    text_before: free text may come first and the calls are optional (tool_choice auto with strict tools).
    exact: refuse (InputError) tools whose parameter schemas use a keyword the rules do not enforce (`unenforced`),
    so that every call the grammar allows fits its schema.
    """
    functions = [t.get("function", t) for t in tools or ()]
    if name is not None:
        functions = [f for f in functions if f.get("name") == name]
        if not functions:
            raise InputError(f"tool_choice: no offered function is named {name!r}")
    if not functions:
        raise InputError("tool_choice: no functions offered to call")
    if exact:
        gaps = sorted({k for f in functions for k in unenforced(f.get("parameters") or {})})
        if gaps:
            raise InputError(f"tools' parameter schemas: the tool-call grammar does not enforce {gaps}")
    rules = _Rules(_token(token_id, STR))
    alts = [f'"{_literal_text(f["name"])}" {rules.value(f.get("parameters") or {"type": "object"}, f["name"])}'
            for f in functions]
    call = f'call: {_token(token_id, CALL_OPEN)} "call:" ({" | ".join(alts)}) {_token(token_id, CALL_CLOSE)}\n'
    once = name is not None or not parallel
    if text_before:  # the calls optional after the text
        body = "text call?" if once else "text call*"
    else:
        body = "call" if once else "call+"
    start = f"start: thought? {body}\n" if thinking else f"start: {body}\n"
    text = f"text: {_TEXT}\n" if text_before else ""
    lark = start + _thought(token_id, thinking) + text + call + rules.text()
    return _compile(lark, "tools' parameter schemas")


# JSON-schema keywords that constrain a value (draft 2020-12 and older), and those _Rules enforces as stated
_VALIDATION = frozenset({
    "type", "enum", "const", "multipleOf", "maximum", "exclusiveMaximum", "minimum", "exclusiveMinimum", "maxLength",
    "minLength", "pattern", "maxItems", "minItems", "uniqueItems", "maxContains", "minContains", "maxProperties",
    "minProperties", "required", "dependentRequired", "allOf", "anyOf", "oneOf", "not", "if", "then", "else",
    "dependentSchemas", "prefixItems", "items", "contains", "properties", "patternProperties", "additionalProperties",
    "propertyNames", "unevaluatedItems", "unevaluatedProperties", "$ref", "$dynamicRef", "additionalItems",
    "dependencies"})
_ENFORCED = frozenset({"type", "enum", "const", "anyOf", "properties", "required", "additionalProperties", "items",
                       "minItems"})


def unenforced(schema) -> set[str]:
    """The validation keywords of a parameter schema (nested ones included) that the tool-call rules do not enforce:
    where they appear, the grammar allows values the schema refuses."""
    if not isinstance(schema, dict):
        return set()
    out = {k for k in schema if k in _VALIDATION and k not in _ENFORCED}
    siblings = {k for k in schema if k in _VALIDATION} - {"type"}
    for key in ("const", "enum", "anyOf"):  # the rules read these alone: another keyword beside them is not read
        if key in schema and siblings - {key}:
            out.add(key)
    if any(isinstance(v, (list, dict)) for v in schema.get("enum", ()) if isinstance(schema.get("enum"), list)):
        out.add("enum")
    if schema.get("minItems", 0) > 1 or not isinstance(schema.get("items", {}), dict):
        out.add("minItems" if schema.get("minItems", 0) > 1 else "items")
    props = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
    if set(schema.get("required") or ()) - set(props):
        out.add("required")  # a required key the schema does not declare: the rules never write it
    extra = schema.get("additionalProperties")
    if not props and extra not in (None, True, False):
        out.add("additionalProperties")
    for sub in [*props.values(), schema.get("items"), *(schema.get("anyOf") or ())]:
        out |= unenforced(sub)
    return out


def _compile(lark: str, what: str) -> str:
    lg = _llguidance()
    grammar = from_lark(lark)
    error = lg.LLMatcher.validate_grammar(grammar)
    if error and not error.startswith("WARNING"):
        raise InputError(f"{what}: cannot be turned into a grammar ({error.strip().splitlines()[0]})")
    return grammar


def _literal_text(text: str) -> str:
    return json.dumps(text)[1:-1]


class _Rules:
    """Lark rules for parameter schemas, named and shared as they are made."""

    def __init__(self, quote: str):
        self.quote = quote
        self.rules: dict[str, str] = {}
        self.any_value()

    def text(self) -> str:
        return "".join(f"{k}: {v}\n" for k, v in self.rules.items())

    def add(self, body: str) -> str:
        for k, v in self.rules.items():
            if v == body:
                return k
        name = f"r{len(self.rules)}"
        self.rules[name] = body
        return name

    def any_value(self) -> str:
        if "anyval" not in self.rules:
            self.rules["anyval"] = "PLACEHOLDER"
            pair = f"{_KEY} \":\" anyval"
            self.rules["anyval"] = (f'{self.quote} {_TEXT} {self.quote} | {_NUMBER} | "true" | "false" | "null" '
                                    f'| "[" (anyval ("," anyval)*)? "]" | "{{" ({pair} ("," {pair})*)? "}}"')
        return "anyval"

    def literal(self, v) -> str:
        if isinstance(v, str):
            return f'{self.quote} "{_literal_text(v)}" {self.quote}'
        if v is None:
            return '"null"'
        if isinstance(v, bool):
            return '"true"' if v else '"false"'
        if isinstance(v, (int, float)):
            return f'"{json.dumps(v)}"'
        return self.any_value()

    def value(self, schema, where: str) -> str:
        if not isinstance(schema, dict):
            return self.any_value()
        if "const" in schema:
            return self.literal(schema["const"])
        if "enum" in schema:
            return self.add(" | ".join(self.literal(v) for v in schema["enum"]))
        for key in ("anyOf", "oneOf"):
            if key in schema:
                return self.add(" | ".join(self.value(s, where) for s in schema[key]))
        kind = schema.get("type")
        if isinstance(kind, list):
            return self.add(" | ".join(self.value({**schema, "type": k}, where) for k in kind))
        if kind == "string":
            return self.add(f"{self.quote} {_TEXT} {self.quote}")
        if kind == "integer":
            return self.add(_INT)
        if kind == "number":
            return self.add(_NUMBER)
        if kind == "boolean":
            return self.add('"true" | "false"')
        if kind == "null":
            return '"null"'
        if kind == "array":
            item = self.value(schema.get("items", {}), where)
            return self.add(f'"[" ({item} ("," {item})*)? "]"' if schema.get("minItems", 0) < 1
                            else f'"[" {item} ("," {item})* "]"')
        if kind == "object" or "properties" in schema:
            return self.object(schema, where)
        return self.any_value()

    def object(self, schema: dict, where: str) -> str:
        props = schema.get("properties") or {}
        if not props:
            if schema.get("additionalProperties") is False:
                return self.add('"{" "}"')
            return self.add(f'"{{" ({_KEY} ":" anyval ("," {_KEY} ":" anyval)*)? "}}"')
        required = set(schema.get("required") or ())
        members = [(f'"{_literal_text(k)}:" {self.value(v, where + "." + k)}', k in required) for k, v in props.items()]
        return self.add(f'"{{" {self._members(members, 0, False)} "}}"')

    def _members(self, members: list, i: int, after: bool) -> str:
        """Members i.. in order, a comma before each when one came before (`after`); optional ones may be left out."""
        if i == len(members):
            return '""'
        member, required = members[i]
        comma = '"," ' if after else ""
        taken = f"{comma}{member} {self._members(members, i + 1, True)}"
        if required:
            return self.add(taken)
        return self.add(f"({taken}) | ({self._members(members, i + 1, after)})")
