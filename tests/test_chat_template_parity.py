"""Chat templates render to the same prompt ids through diffgemma as through transformers' apply_chat_template.

Each template of the set below is written beside the demo's tokenizer.json / tokenizer_config.json; transformers
loads that folder with AutoTokenizer, diffgemma with Tokenizer.from_dir, and every conversation of the set must
give identical ids (and text). The set covers what hub templates use and our demo template does not: one block
tag per line (trim_blocks / lstrip_blocks), `{%- -%}` styles, loop controls, `tojson` of strings that HTML
escaping would change and of unicode, with json.dumps' options, undefined optional variables, the
`{% generation %}` block, namespace / dict, tools and documents, reasoning under its older names, keys whose
value is None, caller keywords, the other special-token texts, and thinking on and off. Images: the same
comparison against transformers' Gemma-4 processor on a character-level tokenizer (tests/test_vision_chat.py).
"""

import shutil

import pytest

pytest.importorskip("transformers")
pytest.importorskip("jinja2")

from diffgemma.errors import InputError  # noqa: E402
from diffgemma.loader import embedded_model_path  # noqa: E402
from diffgemma.tokenizer import Tokenizer  # noqa: E402

DEMO = embedded_model_path()

# One block tag per line, indented, as most hub templates are written.
PER_LINE = """{{ bos_token }}
{% for message in messages %}
    {% if message['role'] == 'system' %}
<|turn>system
{{ message['content'] }}<turn|>
    {% elif message['role'] == 'user' %}
<|turn>user
{{ message['content'] }}<turn|>
    {% else %}
<|turn>model
        {% if message.reasoning_content is defined and enable_thinking %}
<|channel>thought
{{ message.reasoning_content }}<channel|>
        {% endif %}
{{ message['content'] }}<turn|>
    {% endif %}
{% endfor %}
{% if add_generation_prompt %}
<|turn>model
{% endif %}
"""

# Whitespace control on every tag, loop controls, namespace and the generation block.
DASHED = """{%- set ns = namespace(count=0) -%}
{{- bos_token -}}
{%- for m in messages -%}
    {%- if m.role == 'system' -%}{%- continue -%}{%- endif -%}
    {%- if ns.count >= 3 -%}{%- break -%}{%- endif -%}
    {%- set ns.count = ns.count + 1 -%}
<|turn>{{ m.role }}
{%- if m.role == 'assistant' %}
{% generation %}{{ m.content }}{% endgeneration %}
{%- else %}
{{ m.content }}
{%- endif %}<turn|>
{% endfor -%}
{%- if add_generation_prompt -%}<|turn>model
{%- endif -%}
"""

# tojson: plain, with indent / sort_keys / separators / ensure_ascii; dict(); tools and documents.
JSON = """{{ bos_token }}{% if tools %}<|turn>system
{{ tools | tojson }}
{{ tools | tojson(indent=2, sort_keys=True) }}
{% for t in tools %}{{ t | tojson(separators=(',', ':')) }}{% endfor %}<turn|>
{% endif %}
{% if documents %}{% for d in documents %}[{{ d.title }}] {{ d | tojson(ensure_ascii=True) }}
{% endfor %}{% endif %}
{% for m in messages %}<|turn>{{ m.role }}
{{ m.content | tojson if m.content is defined }}{{ dict(role=m.role, n=loop.index) | tojson }}
{% if m.tool_calls %}{% for c in m.tool_calls %}<|tool_call>{{ c.function | tojson }}<tool_call|>{% endfor %}{% endif %}
<turn|>
{% endfor %}{% if add_generation_prompt %}<|turn>model
{% endif %}"""

# Variables nobody passes render empty; tests on them, their attributes and keys that are missing or None.
OPTIONAL = """{{ bos_token }}{{ no_such_variable }}{% if custom_flag is defined %}[flag={{ custom_flag }}]{% endif %}
{% if date_string is not defined %}{% set date_string = strftime_now('%Y') | length %}{% endif %}[{{ date_string }}]
{{ eos_token }}|{{ unk_token }}|{{ pad_token }}|{{ filler_token }}|{{ sep_token }}
{% for m in messages %}<|turn>{{ m.role }}{% if m.name %} name={{ m.name }}{% endif %}
{% if 'content' in m %}{{ m.content }}{% else %}(no content){% endif %}{{ m.missing }}
{% if m.thinking %}<|channel>{{ m.thinking }}<channel|>{% endif %}<turn|>
{% endfor %}{% if add_generation_prompt %}<|turn>model
{% if enable_thinking %}<|think|>{% endif %}{% endif %}"""

TEMPLATES = {"demo": None, "per_line": PER_LINE, "dashed": DASHED, "json": JSON, "optional": OPTIONAL}

TRICKY = "a <b> & 'c' \"d\" </script> \\n é ß 漢字 ☃ 🙂"
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather <now> & 'then'",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string", "description": "a \"city\" é"}},
                                                "required": ["city"]}}}

CONVERSATIONS = {
    "plain": dict(messages=[{"role": "user", "content": "What is 12 + 30?"}]),
    "system": dict(messages=[{"role": "system", "content": "Be brief."},
                             {"role": "user", "content": "Hi"},
                             {"role": "assistant", "content": "Hello."},
                             {"role": "user", "content": "Again"}]),
    "tricky": dict(messages=[{"role": "user", "content": TRICKY},
                             {"role": "assistant", "content": TRICKY},
                             {"role": "user", "content": "ok"}]),
    "tools": dict(messages=[{"role": "user", "content": "Weather in Paris?"},
                            {"role": "assistant", "content": None, "tool_calls": [
                                {"type": "function", "function": {"name": "get_weather",
                                                                  "arguments": {"city": "Paris <&>"}}}]},
                            {"role": "tool", "name": "get_weather", "content": "sunny 'warm'"}],
                  tools=[WEATHER]),
    "reasoning": dict(messages=[{"role": "user", "content": "2+2?"},
                                {"role": "assistant", "content": "4", "reasoning": "two and two"},
                                {"role": "user", "content": "3+3?"}]),
    "many": dict(messages=[{"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i}", "name": None}
                           for i in range(7)]),
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """name -> folder holding the demo's tokenizer files and that template."""
    out = {}
    for name, template in TEMPLATES.items():
        d = tmp_path_factory.mktemp(f"tpl_{name}")
        for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            shutil.copy(DEMO / f, d / f)
        if template is not None:
            (d / "chat_template.jinja").write_text(template)
        out[name] = d
    return out


def _both(folder):
    from transformers import AutoTokenizer

    return Tokenizer.from_dir(folder), AutoTokenizer.from_pretrained(str(folder))


def _render(ours, theirs, conv, **kw):
    messages, tools = conv["messages"], conv.get("tools")
    hf = dict(tools=tools, return_dict=False, **kw)
    want_text = theirs.apply_chat_template(messages, tokenize=False, **hf)
    want_ids = list(theirs.apply_chat_template(messages, tokenize=True, **hf))
    got_text = ours.apply_chat_template(messages, tools=tools, tokenize=False, **kw)
    got_ids = ours.apply_chat_template(messages, tools=tools, **kw)
    return want_text, want_ids, got_text, got_ids


@pytest.mark.parametrize("template", list(TEMPLATES))
def test_prompt_ids_equal_transformers(folders, template):
    ours, theirs = _both(folders[template])
    cases = 0
    for conv_name, conv in CONVERSATIONS.items():
        if template == "demo" and conv_name == "many":
            continue  # the demo template requires alternating roles after a tool call; "many" has none
        for think in (False, True):
            for gen in (True, False):
                want_text, want_ids, got_text, got_ids = _render(ours, theirs, conv, add_generation_prompt=gen,
                                                                 enable_thinking=think)
                where = f"{template}/{conv_name} thinking={think} generation_prompt={gen}"
                assert got_text == want_text, where
                assert got_ids == want_ids, where
                cases += 1
    assert cases >= 20


def test_documents_and_caller_keywords_reach_the_template(folders):
    ours, theirs = _both(folders["json"])
    docs = [{"title": "A <1>", "text": "x & y 漢"}, {"title": "B", "text": "'q'"}]
    conv = CONVERSATIONS["plain"]
    want = theirs.apply_chat_template(conv["messages"], documents=docs, tokenize=False, add_generation_prompt=True)
    got = ours.apply_chat_template(conv["messages"], documents=docs, tokenize=False)
    assert got == want and "\\u6f22" in got  # ensure_ascii=True escaped the unicode of the documents
    ours, theirs = _both(folders["optional"])
    want = theirs.apply_chat_template(conv["messages"], tokenize=False, custom_flag="on", date_string="today")
    got = ours.apply_chat_template(conv["messages"], tokenize=False, add_generation_prompt=False,
                                   custom_flag="on", date_string="today")
    assert got == want and "[flag=on]" in got and "[today]" in got


def test_template_errors_are_input_errors_where_transformers_raises(folders, tmp_path):
    ours, theirs = _both(folders["demo"])
    bad = [{"role": "user", "content": "a"}, {"role": "system", "content": "late"}]
    with pytest.raises(Exception, match="system message is only allowed first"):
        theirs.apply_chat_template(bad, tokenize=False)
    with pytest.raises(InputError, match="chat template: a system message is only allowed first"):
        ours.apply_chat_template(bad)
    # an attribute of an undefined value raises in both; a namespace refuses underscore names in both
    for src in ("{{ nothing.at.all }}", "{% set ns = namespace(_x=1) %}{{ ns._x }}"):
        (tmp_path / "chat_template.jinja").write_text(src)
        for f in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(DEMO / f, tmp_path / f)
        ours, theirs = _both(tmp_path)
        with pytest.raises(Exception):
            theirs.apply_chat_template(CONVERSATIONS["plain"]["messages"], tokenize=False)
        with pytest.raises(InputError, match="chat template"):
            ours.apply_chat_template(CONVERSATIONS["plain"]["messages"])


# -- images: against transformers' Gemma-4 processor ------------------------------------------------

IMAGE_PER_LINE = """{{ bos_token }}
{% for m in messages %}
<|turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}
    {% if m['content'] is string %}
{{ m['content'] }}
    {% else %}
        {% for p in m['content'] %}
            {% if p['type'] == 'image' and p.image is defined %}
<|image|>
            {% elif p['type'] == 'text' %}
{{ p['text'] }}
            {% endif %}
        {% endfor %}
    {% endif %}
<turn|>
{% endfor %}
{% if add_generation_prompt %}
<|turn>model
{% endif %}
"""


@pytest.mark.parametrize("enable_thinking", [False, True])
def test_image_prompts_equal_the_transformers_processor(tmp_path, enable_thinking):
    pytest.importorskip("PIL")
    from types import SimpleNamespace

    from test_vision_chat import IMAGE, NAME, hf_processor, write_tokenizer
    from tiny_vision import VISION_CONFIGS, image_processor, random_image, token_ids
    from tiny_checkpoints import CONFIGS
    from diffgemma.vision.config import VisionConfig
    from diffgemma.vision.prompt import prepare_parts, render_prompt

    spec = VISION_CONFIGS[NAME]
    text = dict(CONFIGS[spec["text"]], use_bidirectional_attention="vision")
    raw = dict(text_config=text, vision_config=spec["vision"], **token_ids(text["vocab_size"]))
    vision = SimpleNamespace(config=VisionConfig.from_dict(raw, processor=image_processor(NAME).to_dict()))
    tok = write_tokenizer(tmp_path, text["vocab_size"])
    (tmp_path / "chat_template.jinja").write_text(IMAGE_PER_LINE)
    proc = hf_processor(tok)
    proc.chat_template = IMAGE_PER_LINE
    images = [random_image(30, 41, seed=1), random_image(9, 12, seed=2)]
    content = [{"type": "text", "text": "Look:"}, {"type": "image", "image": images[0]},
               {"type": "text", "text": "and"}, {"type": "image", "image": images[1]}]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": content}]
    want = proc.apply_chat_template(messages, tokenize=True, return_dict=True, add_generation_prompt=True,
                                    enable_thinking=enable_thinking)["input_ids"][0]
    ours = [messages[0], {"role": "user", "content": prepare_parts(content, vision)}]
    key, table = render_prompt(Tokenizer.from_dir(tmp_path), vision, ours, add_generation_prompt=True,
                               enable_thinking=enable_thinking)
    assert [IMAGE if t < 0 else t for t in key] == list(want)
    assert len(table) == 2
