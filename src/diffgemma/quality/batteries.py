"""Battery files: prompt fixtures with their checkers (docs/QUALITY.md, 'Battery format').

A battery is a JSON file: {"name", "description", "defaults", "tools", "documents", "prompts"}. Shipped batteries
live in diffgemma/assets/batteries/NAME.json and are named by NAME; any other path to a .json file works too.
Everything is validated on load (ids, fields, checkers), so a broken battery fails before the model loads.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import InputError
from .checkers import validate_check

SHIPPED = Path(__file__).resolve().parents[1] / "assets" / "batteries"
DEFAULT_TEMPLATE = "{document}\n\nQuestion: {question}"
_PROMPT_KEYS = {"id", "family", "prompt", "messages", "system", "tools", "think", "max_new_tokens", "check",
                "probe", "rung", "document", "needle", "question", "template"}
_DEFAULT_KEYS = {"tools", "think", "max_new_tokens", "system", "template"}


@dataclass
class Prompt:
    id: str
    messages: list[dict]
    check: dict | None
    family: str = ""
    tools: list | None = None
    think: bool = False
    max_new_tokens: int | None = None
    probe: str | None = None  # long-context: "doc" or "needle"
    rung: str | None = None  # long-context: the length step this prompt belongs to


@dataclass
class Battery:
    name: str
    prompts: list[Prompt]
    description: str = ""
    digest: str = ""  # sha256 of the file: a resumed campaign must run the same battery
    meta: dict = field(default_factory=dict)


def shipped_names() -> list[str]:
    return sorted(p.stem for p in SHIPPED.glob("*.json") if "." not in p.stem)  # NAME.gate.json are not batteries


def resolve_path(name: str) -> Path:
    p = Path(name)
    if p.suffix == ".json" and p.is_file():
        return p
    shipped = SHIPPED / f"{name}.json"
    if shipped.is_file():
        return shipped
    raise InputError(f"--battery {name}: neither a shipped battery ({', '.join(shipped_names())}) nor a .json file")


def load_battery(name: str) -> Battery:
    path = resolve_path(name)
    raw = path.read_bytes()
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as e:
        raise InputError(f"battery {path}: not valid JSON ({e})") from None
    return parse_battery(data, origin=f"battery {path}", default_name=path.stem,
                         digest=hashlib.sha256(raw).hexdigest())


def parse_battery(data: Any, origin: str = "battery", default_name: str = "battery", digest: str = "") -> Battery:
    if not isinstance(data, dict) or not isinstance(data.get("prompts"), list) or not data["prompts"]:
        raise InputError(f"{origin}: expected an object with a non-empty \"prompts\" list")
    defaults = data.get("defaults") or {}
    bad = set(defaults) - _DEFAULT_KEYS
    if bad:
        raise InputError(f"{origin}: defaults: unknown key(s) {sorted(bad)}; expected {sorted(_DEFAULT_KEYS)}")
    tool_sets = data.get("tools") or {}
    documents = data.get("documents") or {}
    prompts, seen = [], set()
    for i, item in enumerate(data["prompts"]):
        where = f"{origin}: prompts[{i}]"
        if not isinstance(item, dict):
            raise InputError(f"{where}: expected an object")
        item = {**defaults, **item}
        bad = set(item) - _PROMPT_KEYS
        if bad:
            raise InputError(f"{where}: unknown key(s) {sorted(bad)}; expected some of {sorted(_PROMPT_KEYS)}")
        pid = item.get("id")
        if not isinstance(pid, str) or not pid:
            raise InputError(f"{where}: \"id\" must be a non-empty string")
        if pid in seen:
            raise InputError(f"{where}: id {pid!r} appears twice")
        seen.add(pid)
        where = f"{origin}: prompt {pid!r}"
        prompts.append(_prompt(item, pid, where, tool_sets, documents))
    return Battery(name=str(data.get("name") or default_name), prompts=prompts,
                   description=str(data.get("description", "")), digest=digest)


def _prompt(item: dict, pid: str, where: str, tool_sets: dict, documents: dict) -> Prompt:
    messages = _messages(item, where, documents)
    tools = item.get("tools")
    if isinstance(tools, str):
        if tools not in tool_sets:
            raise InputError(f"{where}: tools {tools!r}: not among the battery's tool sets {sorted(tool_sets)}")
        tools = tool_sets[tools]
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise InputError(f"{where}: tools: expected a list of declarations or the name of one of the battery's sets")
    mnt = item.get("max_new_tokens")
    if mnt is not None and (isinstance(mnt, bool) or not isinstance(mnt, int) or mnt < 1):
        raise InputError(f"{where}: max_new_tokens {mnt!r}: expected a positive integer")
    if not isinstance(item.get("think", False), bool):
        raise InputError(f"{where}: think: expected true or false")
    probe = item.get("probe")
    if probe not in (None, "doc", "needle"):
        raise InputError(f"{where}: probe {probe!r}: expected \"doc\" or \"needle\"")
    if probe is not None and not isinstance(item.get("rung"), str):
        raise InputError(f"{where}: a long-context probe needs \"rung\" (the length step it belongs to)")
    check = item.get("check")
    if check is not None:
        validate_check(check, where)
    return Prompt(id=pid, messages=messages, check=check, family=str(item.get("family", "")), tools=tools,
                  think=bool(item.get("think", False)), max_new_tokens=mnt, probe=probe, rung=item.get("rung"))


def _messages(item: dict, where: str, documents: dict) -> list[dict]:
    given = [k for k in ("prompt", "messages", "document") if k in item]
    if len(given) != 1:
        raise InputError(f"{where}: give exactly one of \"prompt\", \"messages\" or \"document\" (+ \"question\")")
    head = [{"role": "system", "content": item["system"]}] if item.get("system") else []
    if "prompt" in item:
        if not isinstance(item["prompt"], str) or not item["prompt"]:
            raise InputError(f"{where}: prompt: expected a non-empty string")
        return head + [{"role": "user", "content": item["prompt"]}]
    if "messages" in item:
        msgs = item["messages"]
        if not isinstance(msgs, list) or not msgs or not all(isinstance(m, dict) and "role" in m for m in msgs):
            raise InputError(f"{where}: messages: expected a non-empty list of {{\"role\": ..., \"content\": ...}}")
        return head + [dict(m) for m in msgs]
    doc_name, question = item["document"], item.get("question")
    if doc_name not in documents or not isinstance(documents[doc_name], str):
        raise InputError(f"{where}: document {doc_name!r}: not among the battery's documents {sorted(documents)}")
    if not isinstance(question, str) or not question:
        raise InputError(f"{where}: a document prompt needs a \"question\" string")
    document = insert_needle(documents[doc_name], item.get("needle"), where)
    template = item.get("template") or DEFAULT_TEMPLATE
    try:
        content = template.format(document=document, question=question)
    except (KeyError, IndexError, ValueError) as e:
        raise InputError(f"{where}: template: {e!r}; it may use {{document}} and {{question}} only") from None
    return head + [{"role": "user", "content": content}]


def insert_needle(document: str, needle, where: str) -> str:
    """The document with the needle sentence inserted at a paragraph break near `depth` (0 = start, 1 = end)."""
    if needle is None:
        return document
    if not isinstance(needle, dict) or not isinstance(needle.get("text"), str):
        raise InputError(f"{where}: needle: expected {{\"text\": ..., \"depth\": 0..1}}")
    depth = needle.get("depth", 0.5)
    if isinstance(depth, bool) or not isinstance(depth, (int, float)) or not 0 <= depth <= 1:
        raise InputError(f"{where}: needle depth {depth!r}: expected a number in [0, 1]")
    paragraphs = document.split("\n\n")
    at = round(depth * len(paragraphs))
    return "\n\n".join(paragraphs[:at] + [needle["text"]] + paragraphs[at:])
