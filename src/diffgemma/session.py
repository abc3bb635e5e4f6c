"""One conversation (`Session`): it renders the chat with the template, keeps its KV cache across turns (slots.py:
only what the cache does not hold yet is prefilled), runs each turn as one chat-turn Request through an engine core
(core/: the same loop the server's worker and `diffgemma replay` use, which journals each generation in the op-log,
regenerates a malformed tool call (core/turn.py) or, with tool_repair, repairs an invalid one (core/repair.py)) and
splits each reply into thought, answer and tool calls (reply.py).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from .config import cache_tokens
from .core import EngineCore, Request, resolve
from .errors import InputError
from .events import BlockEvent, ErrorEvent, StepEvent
from .reply import answer_prose, malformed_call_cut, reply_parts, tool_call_message
from .slots import Slot, reuse_prefix
from .tool_repair import ToolRepair
from .vision.prompt import has_images, prepare_parts, render_prompt, vision_for


@dataclass
class Reply:
    answer: str  # what the user sees
    thought: str | None  # the thought channel, when the model wrote one
    raw_text: str  # the decoded reply with its special tokens
    result: object  # the GenerationResult
    reused_tokens: int  # prompt tokens served from the cache
    prefilled_tokens: int  # prompt tokens prefilled this turn
    tool_calls: list = field(default_factory=list)  # parsed <|tool_call> blocks (diffgemma.tool_calls.ToolCall)


class Session:
    def __init__(self, model, *, system: str | None = None, think: bool = False, max_tokens: int | None = None, tools=None,
                 log=None, tool_validate: int = 0, tool_repair: bool = False):
        """log: an oplog.OpLog (header: slots 1, this max_tokens) that journals every turn for `diffgemma replay`.
        tool_validate: with tools, regenerate a malformed tool call up to this many times (core/turn.py).
        tool_repair: with tools, every turn runs the tool repair (the setting `tool_repair`, core/repair.py: an
        invalid call answered with its error and the reply written again, the bad exchange kept out of the cache);
        it takes the place of tool_validate. A turn's own `tool_repair=` keyword overrides it."""
        if not isinstance(tool_validate, int) or isinstance(tool_validate, bool) or tool_validate < 0:
            raise InputError(f"tool_validate: expected a whole number of retries >= 0, got {tool_validate!r}")
        if not isinstance(tool_repair, bool):
            raise InputError(f"tool_repair: expected True or False, got {tool_repair!r}")
        if getattr(model, "tokenizer", None) is None:
            raise InputError(f"{getattr(model, 'path', 'model')}: has no tokenizer.json; chat needs a tokenizer")
        self.model = model
        self.tokenizer = model.tokenizer
        self.think = think
        self.tools = tools
        self.messages: list[dict] = [{"role": "system", "content": system}] if system else []
        self.slot = Slot(model.new_cache(cache_tokens(model.config, max_tokens)))
        self.log = log
        self.tool_validate = tool_validate
        self.tool_repair = tool_repair
        self.repair = ToolRepair(self.tokenizer, tools) if tools is not None else None
        self._gens = itertools.count()  # generations journaled (a turn with a regenerated tool call takes several)

    def call_cut(self, reply: list[int]) -> int | None:
        """Where a reply's malformed tool call opens (reply.malformed_call_cut), or None."""
        return malformed_call_cut(self.tokenizer, reply)

    @property
    def cache(self):
        return self.slot.cache

    @property
    def cached_ids(self) -> list[int]:
        """The token ids the KV cache holds (with images: a prompt key, each image's run a negative sentinel)."""
        return self.slot.ids

    def reset(self) -> None:
        """Start a new conversation: the system prompt stays; the turns after it and the cache go."""
        self.messages = [m for m in self.messages[:1] if m["role"] == "system"]
        self.slot.ids = []
        self.cache.truncate(0)

    def render(self) -> list[int]:
        """The conversation's prompt: its token ids, or with images its prompt key (vision/prompt.py)."""
        return self._render()[0]

    def _render(self) -> tuple[list[int], dict]:
        vision = vision_for(self.model) if has_images(self.messages) else None
        return render_prompt(self.tokenizer, vision, self.messages, tools=self.tools, add_generation_prompt=True,
                             enable_thinking=self.think)

    def _with_images(self, message: dict) -> dict:
        """The message with its image parts decoded (each image once, errors before any model work)."""
        content = message.get("content")
        if isinstance(content, list) and has_images([message]):
            return {**message, "content": prepare_parts(content, vision_for(self.model))}
        return message

    def ask(self, content, images=None, **kw) -> Reply:
        """A user turn: render, reuse the cached prefix, generate the model's reply. A turn that fails (e.g. the
        conversation no longer fits the cache) leaves the conversation as it was before it. `content`: text, or a
        list of content parts ({"type": "text", "text": ...}, {"type": "image", "image": a path, bytes or a PIL
        image}); `images`: images to put before the text. Keywords: `settings` (a GenerationSettings; default the
        model's), any GenerationSettings field as an override on top of it, and callbacks `on_step(StepEvent)`,
        `on_block(BlockEvent)`, `on_event(event)` (every event of events.py)."""
        if images is not None:
            if not isinstance(images, (list, tuple)):
                images = [images]
            parts = content if isinstance(content, list) else ([{"type": "text", "text": content}] if content else [])
            content = [{"type": "image", "image": x} for x in images] + parts
        return self._turn(self._with_images({"role": "user", "content": content}), kw)

    def _turn(self, message: dict, kw) -> Reply:
        self.messages.append(message)
        try:
            return self._generate_turn(**kw)
        except BaseException:
            self.messages.pop()
            raise

    def _generate_turn(self, *, on_step=None, on_block=None, on_event=None, settings=None, **overrides) -> Reply:
        ids, images = self._render()
        keep = reuse_prefix(self.cache, self.slot.ids, ids)
        new = ids[keep:]

        def relay(event):
            if on_step is not None and isinstance(event, StepEvent):
                on_step(event)
            elif on_block is not None and isinstance(event, BlockEvent):
                on_block(event)
            if on_event is not None:
                on_event(event)

        if self.tool_repair:
            overrides = {"tool_repair": True, **overrides}
        request = Request(resolve(self.model, settings, overrides), prompt=new, slot=self.slot, images=images,
                          turn=True, tool_retries=self.tool_validate if self.tools is not None else 0,
                          call_cut=self.call_cut, repair=self.repair, log=self.log, next_gen=lambda: next(self._gens),
                          sink=relay)
        end = EngineCore(self.model).run([request])[0]
        if isinstance(end, ErrorEvent):
            raise end.error
        result = end.result
        raw, thought, answer, calls = reply_parts(self.tokenizer, result.tokens, result.settings.stop_strings)
        # History keeps the answer only: reasoning never crosses a turn boundary.
        if calls and all(c.ok for c in calls):
            self.messages.append(tool_call_message(answer_prose(answer), calls))
        else:
            self.messages.append({"role": "assistant", "content": answer})
        return Reply(answer=answer, thought=thought, raw_text=raw, result=result, reused_tokens=keep,
                     prefilled_tokens=len(new), tool_calls=calls)

    def tool_result(self, name: str, content, **kw) -> Reply:
        """Answer the model's tool call with its result (a dict or text) and let the model continue its turn."""
        if not self.messages or not self.messages[-1].get("tool_calls"):
            raise InputError("tool_result: the last assistant message made no tool call")
        return self._turn({"role": "tool", "name": name, "content": content}, kw)


def chat(model, messages: list[dict], *, think: bool = False, tools=None, **overrides) -> str:
    """Template + generate + decode for a whole message list; returns the answer text."""
    if not messages or messages[-1].get("role") != "user":
        raise InputError("chat: messages must end with a user message")
    session = Session(model, think=think, tools=tools)
    session.messages = [session._with_images(dict(m)) for m in messages[:-1]]
    return session.ask(messages[-1]["content"], **overrides).answer
