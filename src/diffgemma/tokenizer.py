"""Tokenizer: tokenizer.json through `tokenizers`, the chat template through jinja2.

A checkpoint directory carries tokenizer.json (required), tokenizer_config.json (special tokens,
optional) and chat_template.jinja (optional; tokenizer_config.json's "chat_template" is the fallback).
The special ids the engine needs (pad, bos, eos, the turn end and the tool-response opener that stop a
reply, the filler sentinel) are resolved here by token text so nothing downstream hard-codes numbers.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

from .errors import CheckpointError, InputError

# Gemma-4 special-token texts. The real model's ids are pad=0, eos=1, bos=2, <|tool_response>=50, <turn|>=106;
# the demo tokenizer keeps that layout (tools/build_tokenizer.py).
PAD, EOS, BOS = "<pad>", "<eos>", "<bos>"
TURN_OPEN, TURN_END = "<|turn>", "<turn|>"
TOOL_RESPONSE_OPEN = "<|tool_response>"
FILLER = "<|filler|>"


# The names transformers' tokenizers hand a chat template as variables (tokenizer_config.json's special tokens);
# any other config key ending in "_token" with a token text joins them, as do extra_special_tokens' names.
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# A message's reasoning under its older names; templates read "reasoning_content" (and gpt-oss ones "thinking").
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _raise_exception(msg):
    raise InputError(f"chat template: {msg}")


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    """`tojson` as chat templates expect it: plain JSON (no HTML escaping), json.dumps' layout options."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt):
    from datetime import datetime

    return datetime.now().strftime(fmt)


class _TemplateDict:
    """The template's `dict`: calls and fromkeys only, no attribute access to the type itself."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


def _check_namespace_name(name):
    if isinstance(name, str) and name.startswith("_"):
        raise InputError(f"chat template: a namespace attribute may not start with '_' (got {name!r})")


@functools.lru_cache(maxsize=8)
def _compile(template: str):
    """Compile a chat template in the environment transformers' apply_chat_template uses: a sandbox with
    trim_blocks and lstrip_blocks, loop controls, the {% generation %} block (rendered as its body), lenient
    undefined variables, and the globals raise_exception, strftime_now, dict and namespace."""
    # Compiling parses and generates code where a render only runs it: compiled templates are cached by source.
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Namespace(jinja2.utils.Namespace):
        def __init__(*args, **kwargs):  # noqa: N805 - jinja's signature: `self` may be a namespace key
            self, attrs = args[0], dict(*args[1:], **kwargs)
            for name in attrs:
                _check_namespace_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            _check_namespace_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

    class Generation(jinja2.ext.Extension):
        # {% generation %}...{% endgeneration %} marks the assistant's text for training masks; rendering keeps it.
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.Scope(body).set_lineno(lineno)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, dict=_TemplateDict(),
                       namespace=Namespace)
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise CheckpointError(f"chat template does not parse: {e}") from None


def _template_message(message: dict) -> dict:
    """A message as the template sees it: keys whose value is None dropped, the reasoning under every name."""
    m = {k: v for k, v in message.items() if v is not None}
    reasoning = next((m[k] for k in REASONING_FIELDS if m.get(k) is not None), None)
    if reasoning is not None:
        m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
    return m


def render_chat(template: str, messages, tools=None, add_generation_prompt: bool = True,
                enable_thinking: bool = False, bos_token: str = BOS, documents=None, **extra) -> str:
    """Render a chat template (jinja2 source) to text, as transformers' apply_chat_template renders it: the
    template sees messages, tools, documents, add_generation_prompt, enable_thinking, bos_token and `extra`
    (the other special-token texts, caller keywords). Pure: needs no tokenizer files."""
    import jinja2

    tmpl = _compile(template)
    if not isinstance(messages, (list, tuple)) or not all(isinstance(m, dict) and "role" in m for m in messages):
        raise InputError("messages must be a list of {'role': ..., 'content': ...} dicts")
    if documents is not None and not all(isinstance(d, dict) for d in documents):
        raise InputError("documents must be a list of dicts (e.g. {'title': ..., 'text': ...})")
    try:
        return tmpl.render(messages=[_template_message(m) for m in messages], tools=tools, documents=documents,
                           add_generation_prompt=add_generation_prompt, enable_thinking=enable_thinking,
                           bos_token=bos_token, **extra)
    except (jinja2.TemplateError, TypeError, ValueError) as e:  # an attribute of an undefined, tojson of one, ...
        raise InputError(f"chat template: {e}") from None


def special_token_texts(config: dict) -> dict[str, str]:
    """tokenizer_config.json's named special tokens as template variables ({"eos_token": "<eos>", ...})."""
    out = {}
    extra = config.get("extra_special_tokens")
    named = {**config, **(extra if isinstance(extra, dict) else {})}
    for key, value in named.items():
        if isinstance(value, dict):  # an AddedToken written out
            value = value.get("content")
        if isinstance(value, str) and (key in SPECIAL_TOKEN_NAMES or key.endswith("_token")):
            out[key] = value
    return out


class Tokenizer:
    def __init__(self, tokenizer_json: str | Path, chat_template: str | None = None,
                 config: dict | None = None):
        from tokenizers import Tokenizer as _HFTokenizer

        path = Path(tokenizer_json)
        try:
            self._tok = _HFTokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises a bare Exception on malformed JSON
            raise CheckpointError(f"{path}: not a valid tokenizer.json ({e})") from None
        self.path = path
        self.config = config or {}
        self.chat_template = chat_template
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)

        # The template sees the special-token texts by name; pad, eos and bos default to Gemma's.
        self.special_tokens = {"pad_token": PAD, "eos_token": EOS, "bos_token": BOS,
                               **special_token_texts(self.config)}
        self.pad_id = self._need(self.special_tokens["pad_token"])
        self.eos_id = self._need(self.special_tokens["eos_token"])
        self.bos_id = self._need(self.special_tokens["bos_token"])
        self.turn_end_id = self._need(TURN_END)
        self.turn_open_id = self._need(TURN_OPEN)
        self.tool_response_id = self.token_to_id(TOOL_RESPONSE_OPEN)
        self.filler_id = self.token_to_id(FILLER)
        # The ids that end a reply, as generation_config.json's eos_token_id lists them.
        self.stop_ids = tuple(i for i in (self.eos_id, self.turn_end_id, self.tool_response_id) if i is not None)

    @classmethod
    def from_dir(cls, path: str | Path) -> "Tokenizer":
        path = Path(path)
        tj = path / "tokenizer.json"
        if not tj.is_file():
            raise CheckpointError(f"{path}: no tokenizer.json")
        config = {}
        if (path / "tokenizer_config.json").is_file():
            try:
                config = json.loads((path / "tokenizer_config.json").read_text())
            except json.JSONDecodeError as e:
                raise CheckpointError(f"{path / 'tokenizer_config.json'}: not valid JSON ({e})") from None
        template = None
        if (path / "chat_template.jinja").is_file():
            template = (path / "chat_template.jinja").read_text()
        elif isinstance(config.get("chat_template"), str):
            template = config["chat_template"]
        return cls(tj, template, config)

    def _need(self, text: str) -> int:
        i = self._tok.token_to_id(text)
        if i is None:
            raise CheckpointError(f"{self.path}: special token {text!r} is missing from the vocabulary")
        return i

    def backend_json(self) -> str:
        """The tokenizer.json this tokenizer was made from, as text (what a grammar engine reads)."""
        return self._tok.to_str()

    def token_to_id(self, text: str) -> int | None:
        return self._tok.token_to_id(text)

    def id_to_token(self, i: int) -> str | None:
        return self._tok.id_to_token(int(i))

    def encode(self, text: str) -> list[int]:
        """Text to ids. Special-token texts inside `text` (e.g. "<|turn>") become their ids; nothing is added."""
        if not isinstance(text, str):
            raise InputError(f"encode expects a str, got {type(text).__name__}")
        # encode_batch gives encode's ids and releases the interpreter lock while it runs, so a long prompt
        # tokenized in the server's thread pool does not stall its event loop
        return self._tok.encode_batch([text], add_special_tokens=False)[0].ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise InputError(f"decode: ids {bad[:5]} outside the vocabulary [0, {self.vocab_size})")
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages, tools=None, add_generation_prompt: bool = True,
                            enable_thinking: bool = False, tokenize: bool = True, documents=None, **kwargs):
        """Render messages with the checkpoint's chat template; ids (default) or the text (tokenize=False).
        `kwargs` reach the template as variables (over the special-token texts), as in transformers."""
        if self.chat_template is None:
            raise CheckpointError(f"{self.path.parent}: no chat_template.jinja (and none in tokenizer_config.json)")
        variables = {**self.special_tokens, **kwargs}
        text = render_chat(self.chat_template, messages, tools=tools, add_generation_prompt=add_generation_prompt,
                           enable_thinking=enable_thinking, documents=documents, **variables)
        return self.encode(text) if tokenize else text

    def __len__(self) -> int:
        return self.vocab_size


def load_tokenizer(path: str | Path) -> Tokenizer | None:
    """The tokenizer of a checkpoint directory, or None when it has no tokenizer.json."""
    path = Path(path)
    if not (path / "tokenizer.json").is_file():
        return None
    return Tokenizer.from_dir(path)
