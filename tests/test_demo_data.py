"""tools/demo_data.py: deterministic, correct answers, disjoint held-out splits, the Gemma-4 grammar."""

import random
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

import demo_data as dd  # noqa: E402


def test_generation_is_deterministic_in_the_seed():
    seed = random.randrange(10**6)
    a = dd.generate("train", 300, seed)
    b = dd.generate("train", 300, seed)
    assert [(e.key, e.target, e.messages) for e in a] == [(e.key, e.target, e.messages) for e in b]
    c = dd.generate("train", 300, seed + 1)
    assert [e.target for e in a] != [e.target for e in c]


def test_heldout_items_never_appear_in_training():
    seed = random.randrange(10**6)
    train = dd.generate("train", 4000, seed)
    held = dd.heldout_set(40)
    assert all(e.split == "train" for e in train)
    train_keys = {e.key for e in train}
    overlap = [e.key for e in held if e.family not in dd.NO_HELDOUT and e.key in train_keys]
    assert overlap == []
    fams = {e.family for e in held}
    assert fams == set(dd.FAMILIES)
    # the held-out fraction is what the module says (within sampling error)
    keys = [f"k{random.random()}" for _ in range(4000)]
    frac = sum(dd.split_of(k) == "heldout" for k in keys) / len(keys)
    assert abs(frac - dd.HELDOUT_FRACTION) < 0.03


def test_tool_cities_split_is_shared_by_call_and_answer_families():
    all_cities = dd.CITIES + dd.SYNTHETIC_CITIES + dd.TOKEN_WORDS
    held_cities = {c for c in all_cities if dd.split_of(f"city:{c}") == "heldout"}
    assert held_cities and len(held_cities) < len(all_cities)
    assert not set(dd.CITIES) & (set(dd.SYNTHETIC_CITIES) | set(dd.TOKEN_WORDS))
    assert len(dd.TOKEN_WORDS) > 100  # read from the shipped tokenizer
    for e in dd.heldout_set(30):
        if e.family in ("tool_call", "tool_answer") and "city:" in e.key:
            assert e.key.split(":", 1)[1] in held_cities


def _user_text(e):
    return [m for m in e.messages if m["role"] == "user"][-1]["content"]


def test_answers_are_correct():
    rng = random.Random()
    for _ in range(400):
        e = dd.arith(rng)
        a, op, b = re.search(r"(\d+)\s*(\+|-|\*|plus|minus|times)\s*(\d+)", _user_text(e)).groups()
        want = {"+": int(a) + int(b), "plus": int(a) + int(b), "-": int(a) - int(b), "minus": int(a) - int(b),
                "*": int(a) * int(b), "times": int(a) * int(b)}[op]
        assert e.target == f"{want}<turn|>" and e.answer == str(want)
        s = dd.sort_task(rng)
        nums = [int(x) for x in _user_text(s).split(":")[-1].split()]
        assert s.answer == " ".join(map(str, sorted(nums)))
        br = dd.brackets(rng)
        seq = _user_text(br).split(":")[-1].split() + br.answer.split()
        stack = []
        for ch in seq:
            if ch in "([{<":
                stack.append(ch)
            else:
                assert stack and dd._OPEN_CLOSE[stack.pop()] == ch
        assert not stack
        c = dd.count(rng)
        lo, hi = re.search(r"from (\w+) to (\w+)", _user_text(c)).groups()
        items = c.answer.split(", ")
        assert items[0] == lo and items[-1] == hi and len(items) == len(set(items))
        t = dd.think(rng)
        x, y, z = map(int, re.findall(r"\d+", _user_text(t)))
        assert t.answer == str(x + y + z) and t.target.endswith(f"<channel|>{x + y + z}<turn|>")
        assert t.enable_thinking


def test_stop_tokens_and_tool_call_grammar():
    rng = random.Random()
    # transformers' gemma4 response grammar (cli/serving/utils.py): call:NAME{...} with <|"|> string delimiters
    call_re = re.compile(r'^<\|tool_call>call:(\w+)\{(.*)\}<tool_call\|><\|tool_response>$')
    for _ in range(200):
        e = dd.tool_call(rng)
        m = call_re.match(e.target)
        assert m, e.target
        assert m.group(1) == e.meta["name"]
        for k, v in e.meta["args"].items():
            want = f'{k}:<|"|>{v}<|"|>' if isinstance(v, str) else f"{k}:{v}"
            assert want in m.group(2)
        assert e.tools == dd.TOOLS
        a = dd.tool_answer(rng)
        assert a.target.endswith("<turn|>") and a.messages[-1]["role"] == "tool"
        assert a.messages[-2]["tool_calls"][0]["function"]["name"] == a.messages[-1]["name"]
        for fam in ("arith", "facts", "count", "sort", "brackets", "fillin", "greet"):
            f = dd.FAMILIES[fam](rng)
            assert f.target.endswith("<turn|>") and f.target.count("<turn|>") == 1


def test_long_answers_span_several_canvases():
    from diffgemma.loader import embedded_model_path
    from diffgemma.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(embedded_model_path())
    rng = random.Random()
    lens = [len(tok.encode(dd.count(rng).target)) for _ in range(200)]
    assert max(lens) > 3 * 64 and sum(n > 64 for n in lens) > 100


@pytest.mark.parametrize("family", sorted(dd.FAMILIES))
def test_every_family_renders_through_the_chat_template(family):
    from diffgemma.loader import embedded_model_path
    from diffgemma.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(embedded_model_path())
    e = dd.FAMILIES[family](random.Random())
    ids = tok.apply_chat_template(e.messages, tools=e.tools, enable_thinking=e.enable_thinking)
    assert ids[0] == tok.bos_id
    text = tok.decode(ids)
    if e.messages[-1]["role"] == "tool":
        assert text.endswith("<tool_response|>")
    else:
        assert text.endswith("<|turn>model\n")


def test_history_turns_precede_the_item_and_keep_its_split():
    exs = dd.generate("train", 300, seed=3, history_prob=0.5)
    multi = [e for e in exs if sum(m["role"] == "user" for m in e.messages) > 1]
    assert 60 < len(multi) < 240  # about half, one or two earlier exchanges each
    for e in multi:
        roles = [m["role"] for m in e.messages]
        first_user = roles.index("user")
        assert roles[first_user + 1] == "assistant"  # each earlier question is answered
        assert e.split == "train"
    single = dd.generate("train", 50, seed=3)
    assert all(sum(m["role"] == "user" for m in e.messages) == 1 for e in single)


def test_echo_writes_back_the_prompted_word_and_covers_the_one_token_city_names():
    rng = random.Random()
    for _ in range(200):
        e = dd.echo(rng)
        word = _user_text(e).rstrip(".").split()[-1]
        assert e.answer == word and e.target == word + "<turn|>" and e.key == f"echo:{word}"
    if dd.TOKEN_WORDS:  # with the shipped tokenizer: every one-token city word is an echo word too
        assert set(dd.TOKEN_WORDS) <= set(dd.VOCAB_WORDS)
        held = [w for w in dd.VOCAB_WORDS if dd.split_of(f"echo:{w}") == "heldout"]
        assert 0 < len(held) < len(dd.VOCAB_WORDS) * 0.25  # echo keeps its own held-out words


def test_prepare_draws_the_word_pools_from_the_tokenizer_it_prepares_for(tmp_path, monkeypatch):
    """Data for a new tokenizer must teach (echo) and use as city names that tokenizer's words, not those of
    whichever tokenizer is shipped (run 6's data was made with run 5's pools: MODEL_CARD.md)."""
    import shutil

    import build_tokenizer
    import train_demo

    monkeypatch.setattr(dd, "TOKEN_WORDS", dd.TOKEN_WORDS)  # restored after the test
    monkeypatch.setattr(dd, "VOCAB_WORDS", dd.VOCAB_WORDS)
    shipped = set(dd.VOCAB_WORDS)
    tok_dir = tmp_path / "tok"
    tok_dir.mkdir()
    new_tok = build_tokenizer.build(vocab_size=600, n_examples=1500)  # spaces attached: unlike the shipped one
    new_tok.save(str(tok_dir / "tokenizer.json"))
    (tok_dir / "tokenizer_config.json").write_text(__import__("json").dumps(build_tokenizer.tokenizer_config(600)))
    shutil.copy(build_tokenizer.TEMPLATE_PATH, tok_dir / "chat_template.jinja")

    train_demo.prepare(tmp_path / "data", n_train=30, n_heldout_per_family=1, vocab=600, tokenizer=tok_dir)
    want = dd._vocab_words(list(new_tok.get_vocab()))
    assert dd.VOCAB_WORDS == want and set(want) != shipped
    assert dd.TOKEN_WORDS == dd._token_words(list(new_tok.get_vocab()))
    rng = random.Random()
    assert all(dd.echo(rng).answer in set(want) for _ in range(50))
