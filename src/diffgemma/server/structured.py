"""Structured replies: `response_format` (a JSON object, or JSON valid against a schema), a forced tool call
(tool_choice 'required' or a named function), and strict tools' calls fitting their parameter schemas.

Two paths (`constrain`), and the response's `diffgemma.structured` names the one that ran:

- "grammar": the request's constraint is a grammar (grammars.py) set as the generation's `grammar` setting, and the
  reply is valid by construction (sampling/constraint.py; docs/ARCHITECTURE.md, 'Constrained output'). It is
  written once; the check below still runs, and a reply that fails it (the token budget ended before the grammar
  was complete) is a 422 at once: the same budget would end the same way.
- "checked": what no grammar here expresses exactly (a JSON schema keyword llguidance does not implement, a
  parameter schema keyword the tool-call rules do not enforce, JSON or a tool call at the model's choice, or a model
  without a tokenizer to run a grammar over). A looser grammar that every valid reply fits still steers each
  attempt where one can be made (any JSON; calls with the keywords' values unconstrained). The reply is checked
  after it is written and, when it fails, regenerated with the seed bumped by one, up to a number of attempts; a
  reply still failing after the last attempt is an explicit error (HTTP 422, code `response_format_failed`), never
  invalid JSON labelled valid. Without any grammar, a reply that must call a tool starts with the call's opener
  (and the function's name), written into the prompt.

The request's instruction to answer in JSON (and the schema) is also written into the conversation as a system
message, which is what steers the model towards the content the grammar leaves open.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import jsonschema

from .. import grammars
from ..errors import InputError
from ..tool_calls import CALL_OPEN, schema_validator
from ..tool_calls import tool_call_problem  # noqa: F401 (reply_text.py takes the one check from here)
from .errors import RequestError

FORMAT_ATTEMPTS = 4  # a response_format reply is written at most this many times


@dataclass(frozen=True)
class ResponseFormat:
    kind: str  # "json_object" or "json_schema"
    name: str | None = None
    schema: dict | None = None

    def instruction(self) -> str:
        """The system text that asks the model for this format."""
        if self.kind == "json_object":
            return "Answer with a single JSON object and nothing else."
        return ("Answer with a single JSON value and nothing else, valid against this JSON schema"
                + (f" ({self.name})" if self.name else "") + ":\n" + json.dumps(self.schema))

    def problem(self, content: str | None) -> str | None:
        """Why `content` does not satisfy the format, or None when it does."""
        if content is None:
            return "the reply has no content"
        try:
            value = json.loads(content)
        except (json.JSONDecodeError, RecursionError) as e:
            return f"the reply is not valid JSON ({getattr(e, 'msg', 'nested too deeply')})"
        if self.kind == "json_object":
            return None if isinstance(value, dict) else f"the reply is JSON but not an object ({type(value).__name__})"
        error = jsonschema.exceptions.best_match(schema_validator(self.schema).iter_errors(value))
        return None if error is None else f"the reply does not match the schema: {error.message}"


@dataclass(frozen=True)
class Constraint:
    """How a request's structured reply is made: `path` "grammar" or "checked" (module doc), and the grammar the
    generation runs (None: none). why: on the checked path, what the grammar could not express."""

    path: str
    grammar: str | None
    why: str | None = None


def can_constrain(model) -> bool:
    """Whether generations on `model` can run a grammar: llguidance is installed and the model has a tokenizer."""
    try:
        import llguidance  # noqa: F401
    except ImportError:
        return False
    return getattr(model, "tokenizer", None) is not None


def constrain(req, token_id, model, strict_tools: bool = True) -> Constraint | None:
    """A chat request's Constraint, or None when its reply is free text. req: protocol.ChatRequest; token_id: the
    tokenizer's text -> id. strict_tools: tools marked `strict` constrain their calls under tool_choice auto."""
    tools_on = req.tools is not None and req.tool_choice != "none"
    forced = req.tool_choice in ("required", "function")
    strict = tools_on and not forced and strict_tools and any(t["function"].get("strict") for t in req.tools)
    fmt = req.response_format
    if not (forced or fmt is not None or strict):
        return None
    if not can_constrain(model):
        return None if strict else Constraint("checked", None, "this model cannot run a grammar")
    if fmt is not None and tools_on and not forced:
        return Constraint("checked", None, "JSON or a tool call, at the model's choice")
    try:
        return Constraint("grammar", _grammar(req, token_id, forced, strict, exact=True))
    except InputError as e:
        why = str(e)
    try:
        return Constraint("checked", _grammar(req, token_id, forced, strict, exact=False), why)
    except InputError:
        return Constraint("checked", None, why)


def _grammar(req, token_id, forced: bool, strict: bool, exact: bool) -> str:
    """The request's grammar; exact=False: a looser one that every valid reply fits (the schema without what
    llguidance does not implement, else any JSON; calls whose values the rules cannot enforce left free)."""
    fmt = req.response_format
    if fmt is not None and not forced:
        if fmt.kind == "json_object" or exact:
            return grammars.json_grammar(fmt.schema, token_id, thinking=req.think)
        try:
            return grammars.json_grammar(grammars.loosened(fmt.schema), token_id, thinking=req.think)
        except InputError:
            return grammars.json_grammar({}, token_id, thinking=req.think)
    return grammars.tool_call_grammar(req.tools, token_id, name=req.forced_name, text_before=strict,
                                      thinking=req.think, exact=exact, parallel=req.parallel_tool_calls)


def schema_problem(schema) -> str | None:
    """Why `schema` is not a JSON schema a validator can use, or None."""
    if not isinstance(schema, dict):
        return "expected an object"
    try:
        schema_validator(schema).check_schema(schema)
    except jsonschema.SchemaError as e:
        return e.message
    except Exception as e:  # a malformed $schema or $ref the library trips over
        return f"{type(e).__name__}: {e}"
    return None


def parse_response_format(fmt) -> ResponseFormat | None:
    """A request's response_format -> ResponseFormat, None for plain text, or RequestError (400) naming the part."""
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise RequestError(400, "response_format: expected {'type': 'text'}, {'type': 'json_object'} or "
                                "{'type': 'json_schema', 'json_schema': {'name', 'schema'}}", "response_format")
    if fmt["type"] == "text":
        return None
    if fmt["type"] == "json_object":
        return ResponseFormat("json_object")
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("name", ""), str):
        raise RequestError(400, "response_format.json_schema: expected {'name': ..., 'schema': {...}}",
                           "response_format")
    schema = spec.get("schema", {})
    problem = schema_problem(schema)
    if problem is not None:
        raise RequestError(400, f"response_format.json_schema.schema: not a valid JSON schema ({problem})",
                           "response_format")
    return ResponseFormat("json_schema", spec.get("name"), schema)


def format_failed(fmt: ResponseFormat, attempts: int, problem: str) -> RequestError:
    return RequestError(422, f"response_format {fmt.kind}: no reply satisfied it in {attempts} attempt(s); the "
                             f"last: {problem}", "response_format", code="response_format_failed")


def budget_problem(max_tokens: int, problem: str) -> str:
    """A grammar-path reply's problem when its token budget ended it: what to change."""
    return (f"max_tokens ({max_tokens}) ended the reply before its grammar was complete; give it more tokens "
            f"({problem})")


def call_failed(attempts: int, problem: str) -> RequestError:
    return RequestError(422, f"tool_choice: no reply made the required tool call in {attempts} attempt(s); the "
                             f"last: {problem}", "tool_choice", code="tool_choice_failed")


def check_tools_schemas(tools: list[dict] | None) -> None:
    """Refuse (400) a tool whose parameters are not a valid JSON schema: calls could not be checked against it."""
    for i, t in enumerate(tools or []):
        schema = t["function"].get("parameters")
        problem = None if schema is None else schema_problem(schema)
        if problem is not None:
            raise RequestError(400, f"tools[{i}].function.parameters: not a valid JSON schema ({problem})", "tools")


def with_instruction(messages: list[dict], fmt: ResponseFormat) -> list[dict]:
    """The conversation with the format's instruction added to its system message (one is put first if none)."""
    if messages and messages[0]["role"] == "system":
        first = dict(messages[0], content=(messages[0]["content"] + "\n\n" + fmt.instruction()).strip())
        return [first] + messages[1:]
    return [{"role": "system", "content": fmt.instruction()}] + messages


def forced_call_text(name: str | None) -> str:
    """What a reply that must call a tool starts with: the call's opener, and the function's name when named."""
    return CALL_OPEN + (f"call:{name}{{" if name is not None else "")


def call_problem(calls: list, forced_name: str | None) -> str | None:
    """Why a reply that must call a tool (tool_choice 'required' or a named function) does not, or None."""
    if not calls:
        return "no well-formed call to the offered tools"
    if forced_name is not None and any(c.name != forced_name for c in calls):
        return f"a call to another function than {forced_name!r}"
    return None


async def checked(generate, settings, build, check, attempts: int):
    """Generate, build the message, check it; on a problem generate again with the seed bumped by one, up to
    `attempts` times. generate(settings) -> (cached tokens, GenerationResult), or a response to send as it is
    (an error, a cancellation); build(result) -> (message, calls); check(message, calls) -> problem or None.
    -> (cached, result, message, calls, attempts used, last problem or None), or generate's response."""
    for k in range(attempts):
        s = settings if k == 0 else settings.replace(seed=(settings.seed + k) % 2**64)
        done = await generate(s)
        if not isinstance(done, tuple):
            return done
        cached, result = done
        message, calls = build(result)
        problem = check(message, calls)
        if problem is None:
            break
    return cached, result, message, calls, k + 1, problem


def buffered_chunks(make, message: dict, finish_reason: str, usage_: dict | None):
    """A checked reply sent as a stream once it is whole: the role, its text, its tool calls, the finish, and
    the usage when asked. make(delta, finish, usage, choices) builds a chunk. -> server-sent event strings."""
    def sse(obj) -> str:
        return f"data: {json.dumps(obj)}\n\n"

    yield sse(make({"role": "assistant", "content": ""}))
    text = {k: message[k] for k in ("reasoning_content", "content") if message.get(k)}
    if text:
        yield sse(make(text))
    if message.get("tool_calls"):
        yield sse(make({"tool_calls": [dict(c, index=i) for i, c in enumerate(message["tool_calls"])]}))
    yield sse(make({}, finish_reason))
    if usage_ is not None:
        yield sse(make({}, None, usage_, False))
    yield "data: [DONE]\n\n"
