"""diffgemma.tokenizer on the embedded demo checkpoint: special-id layout, round trips, the chat template."""

import json
import random
import string

import pytest

from diffgemma.errors import CheckpointError, InputError
from diffgemma.loader import embedded_model_path
from diffgemma.tokenizer import Tokenizer, load_tokenizer, render_chat

DEMO = embedded_model_path()


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_dir(DEMO)


def test_special_ids_match_the_real_layout_and_the_configs(tok):
    cfg = json.loads((DEMO / "config.json").read_text())["text_config"]
    gen = json.loads((DEMO / "generation_config.json").read_text())
    assert (tok.pad_id, tok.eos_id, tok.bos_id) == (0, 1, 2)
    assert tok.turn_end_id == 106 and tok.turn_open_id == 105 and tok.tool_response_id == 50
    assert tok.stop_ids == (1, 106, 50)
    assert tok.vocab_size == cfg["vocab_size"] == len(tok)
    assert tok.filler_id == tok.vocab_size - 1  # the filler sentinel
    assert sorted(gen["eos_token_id"]) == sorted(cfg["eos_token_id"]) == sorted(tok.stop_ids)
    assert gen["pad_token_id"] == cfg["pad_token_id"] == tok.pad_id
    assert gen["bos_token_id"] == cfg["bos_token_id"] == tok.bos_id
    for text, i in {"<|tool_call>": 48, "<tool_call|>": 49, '<|"|>': 52, "<|channel>": 100, "<channel|>": 101,
                    "<|think|>": 98, "<|tool>": 46, "<tool|>": 47, "<tool_response|>": 51}.items():
        assert tok.token_to_id(text) == i, text


def test_round_trip_of_random_text_with_special_tokens(tok):
    rng = random.Random()
    specials = ["<|turn>", "<turn|>", "<|tool_call>", '<|"|>', "<eos>", "\n"]
    alphabet = string.printable + "éßø€漢字"
    for _ in range(50):
        parts = [rng.choice(specials) if rng.random() < 0.2 else
                 "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 12))) for _ in range(rng.randint(1, 8))]
        text = "".join(parts)
        ids = tok.encode(text)
        assert all(0 <= i < tok.vocab_size for i in ids)
        assert tok.decode(ids) == text


def test_special_texts_become_single_ids_and_digits_split(tok):
    ids = tok.encode("<|turn>user\nwhat is 1234+5?<turn|>")
    assert ids[0] == 105 and ids[-1] == 106
    digits = [tok.id_to_token(i) for i in ids if tok.id_to_token(i).isdigit()]
    assert digits == ["1", "2", "3", "4", "5"]
    assert tok.decode(ids, skip_special_tokens=True) == "user\nwhat is 1234+5?"


def test_decode_rejects_out_of_vocab(tok):
    with pytest.raises(InputError, match="outside the vocabulary"):
        tok.decode([5, tok.vocab_size])


def test_chat_template_turns_thinking_and_generation_prompt(tok):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "2+2?"}]
    text = tok.apply_chat_template(msgs, tokenize=False)
    assert text == ("<bos><|turn>system\nBe brief.<turn|>\n<|turn>user\nhi<turn|>\n<|turn>model\nHello!<turn|>\n"
                    "<|turn>user\n2+2?<turn|>\n<|turn>model\n")
    assert tok.apply_chat_template(msgs) == tok.encode(text)
    no_gen = tok.apply_chat_template(msgs[1:2], add_generation_prompt=False, tokenize=False)
    assert no_gen == "<bos><|turn>user\nhi<turn|>\n"
    think = tok.apply_chat_template(msgs[1:2], enable_thinking=True, tokenize=False)
    assert think == "<bos><|turn>system\n<|think|><turn|>\n<|turn>user\nhi<turn|>\n<|turn>model\n"


def test_chat_template_tool_declarations_calls_and_responses(tok):
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather",
              "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    msgs = [{"role": "user", "content": "Weather in Oslo?"},
            {"role": "assistant", "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
            {"role": "tool", "name": "get_weather", "content": {"temperature": 3, "sunny": False}}]
    text = tok.apply_chat_template(msgs, tools=tools, tokenize=False)
    assert text == (
        '<bos><|turn>system\n<|tool>declaration:get_weather{description:<|"|>Weather<|"|>,parameters:'
        '{type:<|"|>object<|"|>,properties:{city:{type:<|"|>string<|"|>}},required:[<|"|>city<|"|>]}}<tool|>'
        "<turn|>\n<|turn>user\nWeather in Oslo?<turn|>\n<|turn>model\n"
        '<|tool_call>call:get_weather{city:<|"|>Oslo<|"|>}<tool_call|>'
        "<|tool_response>response:get_weather{temperature:3,sunny:false}<tool_response|>")
    # the model continues its own turn after a tool response: no new "<|turn>model" header
    assert not text.endswith("<|turn>model\n")


def test_chat_template_errors_are_input_errors(tok):
    with pytest.raises(InputError, match="unknown role"):
        tok.apply_chat_template([{"role": "robot", "content": "x"}])
    with pytest.raises(InputError, match="tool message"):
        tok.apply_chat_template([{"role": "user", "content": "x"}, {"role": "tool", "content": "y"}])
    with pytest.raises(InputError):
        render_chat("{{ messages }}", "not a list")


def test_load_tokenizer_missing_and_malformed(tmp_path):
    assert load_tokenizer(tmp_path) is None
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="tokenizer.json"):
        load_tokenizer(tmp_path)


def test_missing_special_token_is_a_checkpoint_error(tmp_path):
    from tokenizers import Tokenizer as HF, models

    t = HF(models.WordLevel({"<pad>": 0, "<eos>": 1, "<bos>": 2, "a": 3}, unk_token="a"))
    t.save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(CheckpointError, match="<turn|>"):
        Tokenizer.from_dir(tmp_path)


def test_isolated_spaces_give_a_name_the_same_ids_in_a_request_and_in_a_tool_call(tok):
    """tools/build_tokenizer.py --isolate-spaces, the shipped tokenizer's setting since run 6: the property the
    demo model's unseen one-token city names need (with spaces attached, ' Dublin' and 'Dublin' differ)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[1] / "tools"))
    import build_tokenizer

    built = build_tokenizer.build(vocab_size=700, n_examples=1500, isolate_spaces=True)
    names = ["Dublin", "Paris", "Zanlorvi", "Kyoto"]
    for encode in (lambda text: built.encode(text).ids, tok.encode):
        for name in names:
            request = encode(f"What's the weather in {name}?")
            call = encode(f'<|tool_call>call:get_weather{{city:<|"|>{name}<|"|>}}<tool_call|>')
            ids = encode(name)
            assert any(request[i:i + len(ids)] == ids for i in range(len(request))), (name, request, ids)
            assert any(call[i:i + len(ids)] == ids for i in range(len(call))), (name, call, ids)
    assert built.decode(built.encode("in Dublin, 42 days").ids) == "in Dublin, 42 days"
    shipped = build_tokenizer.build(vocab_size=700, n_examples=1500)  # the shipped setting, for contrast
    assert shipped.encode(" Paris").ids != shipped.encode("Paris").ids
