"""Task generators for the embedded demo model: deterministic, chat-format examples with held-out splits.

Every example is a conversation (chat messages + optional tool declarations + thinking flag) and the
exact text the model must produce for the last turn. The split of an example is a pure function of its
*item* (the operands, the list, the city, ...), so the held-out set is disjoint from the training set by
construction, not by sampling luck: `split_of(key)` hashes the item key and sends ~12% to "heldout".

Families (see MODEL_CARD.md):
  arith      add / sub / mul of small numbers                       (easy, held-out: unseen operand pairs)
  facts      successor / predecessor / parity / n-th letter / a small
             memorised table (capitals, opposites)                  (easy, held-out: unseen numbers; for the
                                                                     table, unseen (item, phrasing) pairs)
  count      count from A to B, list letters c..x                   (longer than one canvas -> block chaining)
  think      three-term sums answered through the thought channel   (enable_thinking=True)
  tool_call  a tool call given declarations in the system turn      (ends with <|tool_response>)
  tool_answer the answer after a tool response                      (held-out: unseen cities)
  sort / brackets / fillin   constraint tasks                       (held-out: unseen lists)
  greet      a fixed self-description for greetings
  echo       say one word of the tokenizer's vocabulary back           (held-out: unseen words)

The target text ends with the stop token the engine scans for: "<turn|>" for a normal reply and
"<|tool_response>" after a tool call (the host then appends the response and the model continues).
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass, field
from pathlib import Path

HELDOUT_FRACTION = 0.12
TURN_END = "<turn|>"
TOOL_RESPONSE_OPEN = "<|tool_response>"
STR = '<|"|>'  # Gemma-4 string delimiter inside tool calls / declarations


@dataclass
class Example:
    family: str
    key: str  # the item identity the split is decided on
    messages: list  # chat messages; the model replies after the last one
    target: str  # exact text the model must generate, ending with its stop token
    tools: list | None = None
    enable_thinking: bool = False
    answer: str = ""  # the checkable part of the target (what exact-match compares)
    meta: dict = field(default_factory=dict)

    @property
    def split(self) -> str:
        return split_of(self.key)


def split_of(key: str) -> str:
    h = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little")
    return "heldout" if (h % 10_000) < HELDOUT_FRACTION * 10_000 else "train"


def _user(text: str) -> list:
    return [{"role": "user", "content": text}]


# ----------------------------------------------------------------------------------------------
# arithmetic

_ADD = ["what is {a}+{b}?", "What is {a} + {b}?", "{a}+{b}=?", "compute {a} plus {b}", "What is {a} plus {b}?"]
_SUB = ["what is {a}-{b}?", "What is {a} - {b}?", "{a}-{b}=?", "compute {a} minus {b}", "What is {a} minus {b}?"]
_MUL = ["what is {a}*{b}?", "What is {a} * {b}?", "{a}*{b}=?", "compute {a} times {b}", "What is {a} times {b}?"]


def arith(rng: random.Random) -> Example:
    op = rng.choice("+-*")
    if op == "*":
        a, b = rng.randint(0, 12), rng.randint(0, 12)
        val, tmpl = a * b, rng.choice(_MUL)
    elif op == "+":
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        val, tmpl = a + b, rng.choice(_ADD)
    else:
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        a, b = max(a, b), min(a, b)
        val, tmpl = a - b, rng.choice(_SUB)
    ans = str(val)
    return Example("arith", f"arith:{a}{op}{b}", _user(tmpl.format(a=a, b=b)), ans + TURN_END, answer=ans)


# ----------------------------------------------------------------------------------------------
# short facts

_CAPITALS = {
    "France": "Paris", "Germany": "Berlin", "Italy": "Rome", "Spain": "Madrid", "Japan": "Tokyo",
    "China": "Beijing", "Egypt": "Cairo", "Canada": "Ottawa", "Kenya": "Nairobi", "Peru": "Lima",
    "Norway": "Oslo", "Sweden": "Stockholm", "Poland": "Warsaw", "Greece": "Athens", "Chile": "Santiago",
    "Cuba": "Havana", "Ireland": "Dublin", "Portugal": "Lisbon", "Austria": "Vienna", "India": "New Delhi",
}
_OPPOSITES = {
    "hot": "cold", "big": "small", "up": "down", "fast": "slow", "light": "dark", "happy": "sad",
    "open": "closed", "early": "late", "full": "empty", "hard": "soft", "old": "new", "wet": "dry",
    "high": "low", "rich": "poor", "left": "right", "loud": "quiet", "thick": "thin", "strong": "weak",
}
_LETTERS = "abcdefghijklmnopqrstuvwxyz"
_ORD = {1: "st", 2: "nd", 3: "rd"}


def _ordinal(n: int) -> str:
    return f"{n}{'th' if 10 <= n % 100 <= 20 else _ORD.get(n % 10, 'th')}"


def facts(rng: random.Random) -> Example:
    kind = rng.choice(["next", "prev", "parity", "letter", "capital", "opposite"])
    if kind == "next":
        n = rng.randint(0, 998)
        q = rng.choice(["what comes after {n}?", "What number comes after {n}?", "what is one more than {n}?"])
        return Example("facts", f"next:{n}", _user(q.format(n=n)), f"{n + 1}{TURN_END}", answer=str(n + 1))
    if kind == "prev":
        n = rng.randint(1, 999)
        q = rng.choice(["what comes before {n}?", "What number comes before {n}?", "what is one less than {n}?"])
        return Example("facts", f"prev:{n}", _user(q.format(n=n)), f"{n - 1}{TURN_END}", answer=str(n - 1))
    if kind == "parity":
        n = rng.randint(0, 999)
        q = rng.choice(["is {n} even or odd?", "Is {n} odd or even?"])
        ans = "even" if n % 2 == 0 else "odd"
        return Example("facts", f"parity:{n}", _user(q.format(n=n)), ans + TURN_END, answer=ans)
    if kind == "letter":
        n = rng.randint(1, 26)
        q = rng.choice(["what is the {o} letter of the alphabet?", "Which letter is number {n} in the alphabet?"])
        ans = _LETTERS[n - 1]
        # 26 items only: split on (item, phrasing) so every letter is taught under some phrasing
        return Example("facts", f"letter:{n}:{q[:5]}", _user(q.format(o=_ordinal(n), n=n)), ans + TURN_END, answer=ans)
    if kind == "capital":
        country = rng.choice(sorted(_CAPITALS))
        qs = ["what is the capital of {c}?", "What is the capital city of {c}?", "{c} has which capital?",
              "name the capital of {c}"]
        qi = rng.randrange(len(qs))
        ans = _CAPITALS[country]
        return Example("facts", f"capital:{country}:{qi}", _user(qs[qi].format(c=country)), ans + TURN_END, answer=ans)
    word = rng.choice(sorted(_OPPOSITES))
    qs = ["what is the opposite of {w}?", "What is the opposite of \"{w}\"?", "give the opposite of {w}",
          "opposite of {w}?"]
    qi = rng.randrange(len(qs))
    ans = _OPPOSITES[word]
    return Example("facts", f"opposite:{word}:{qi}", _user(qs[qi].format(w=word)), ans + TURN_END, answer=ans)


# ----------------------------------------------------------------------------------------------
# long structured output (longer than one canvas: block chaining is exercised)


def count(rng: random.Random) -> Example:
    if rng.random() < 0.75:
        a = rng.randint(1, 60)
        b = a + rng.randint(15, 70)
        q = rng.choice(["count from {a} to {b}", "Count from {a} to {b}.", "list the numbers from {a} to {b}"])
        ans = ", ".join(str(i) for i in range(a, b + 1))
        return Example("count", f"count:{a}:{b}", _user(q.format(a=a, b=b)), ans + TURN_END, answer=ans)
    i = rng.randint(0, 15)
    j = rng.randint(i + 6, 25)
    upper = rng.random() < 0.5
    letters = _LETTERS.upper() if upper else _LETTERS
    q = rng.choice(["list the letters from {x} to {y}", "List the letters from {x} to {y}."])
    ans = ", ".join(letters[i : j + 1])
    return Example("count", f"letters:{i}:{j}:{upper}", _user(q.format(x=letters[i], y=letters[j])),
                   ans + TURN_END, answer=ans)


# ----------------------------------------------------------------------------------------------
# thought channel


def think(rng: random.Random) -> Example:
    a, b, c = rng.randint(1, 60), rng.randint(1, 60), rng.randint(1, 60)
    q = rng.choice(["what is {a}+{b}+{c}?", "What is {a} + {b} + {c}?", "add {a}, {b} and {c}"])
    s1 = a + b
    s2 = s1 + c
    target = f"<|channel>thought\n{a}+{b}={s1}, {s1}+{c}={s2}<channel|>{s2}{TURN_END}"
    return Example("think", f"think:{a}:{b}:{c}", _user(q.format(a=a, b=b, c=c)), target,
                   enable_thinking=True, answer=str(s2))


# ----------------------------------------------------------------------------------------------
# tools

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Get the current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "City name"}},
                       "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "get_time", "description": "Get the local time in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "City name"}},
                       "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "add_numbers", "description": "Add two numbers exactly",
        "parameters": {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
                       "required": ["a", "b"]}}},
]

CITIES = [
    "Paris", "London", "Berlin", "Madrid", "Rome", "Tokyo", "Seoul", "Lima", "Oslo", "Cairo", "Dublin",
    "Vienna", "Prague", "Athens", "Lisbon", "Warsaw", "Boston", "Denver", "Chicago", "Austin", "Dallas",
    "Miami", "Seattle", "Toronto", "Sydney", "Perth", "Nairobi", "Lagos", "Delhi", "Mumbai", "Bangkok",
    "Hanoi", "Manila", "Jakarta", "Havana", "Bogota", "Quito", "Santiago", "Helsinki", "Riga", "Zurich",
    "Geneva", "Milan", "Naples", "Munich", "Hamburg", "Lyon", "Nice", "Porto", "Seville", "Valencia",
    "Kyoto", "Osaka", "Busan", "Taipei", "Dubai", "Doha", "Tunis", "Accra", "Dakar", "Oxford", "Leeds",
]
# Made-up city names (syllable strings), so the model learns to COPY the city from the request instead of
# recalling one of 62 memorised names. They split by name like the real ones: held-out names never occur
# in training.
_SYLLABLES = ["ka", "lo", "mi", "ren", "ta", "vi", "sor", "an", "bel", "du", "fen", "gra", "hol", "is", "jun",
              "ker", "lun", "mar", "nor", "ost", "pel", "qua", "ris", "sel", "tor", "ul", "ven", "wes", "yar", "zan",
              "bra", "cel", "dor", "el", "fal", "gan", "ha", "ino", "lar", "mo", "na", "or", "pra", "ros", "sten"]


def _synthetic_cities(n: int = 1500, seed: int = 7) -> list[str]:
    rng, names = random.Random(seed), set()
    while len(names) < n:
        name = "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(2, 3))).capitalize()
        if name not in CITIES:
            names.add(name)
    return sorted(names)


SYNTHETIC_CITIES = _synthetic_cities()


def vocab_of(path) -> list[str]:
    """The tokens of a tokenizer.json ([] where there is none yet, e.g. before the first demo tokenizer)."""
    path = Path(path)
    return list(json.loads(path.read_text())["model"]["vocab"]) if path.exists() else []


SHIPPED_TOKENIZER = Path(__file__).resolve().parents[1] / "src" / "diffgemma" / "assets" / "demo" / "tokenizer.json"


def _token_words(vocab: list[str]) -> list[str]:
    """Alphabetic single tokens of the tokenizer, used as city names too. Real city names are often one BPE
    token each (Dublin, Lisbon), and a held-out city's token never appears in any training target; copying
    many other single tokens teaches the model to copy a token it has never written."""
    return sorted(t for t in vocab if t.isascii() and t.isalpha() and len(t) >= 3 and t not in CITIES)


def _vocab_words(vocab: list[str]) -> list[str]:
    """Every alphabetic token of the tokenizer (with its byte-level space marker dropped), for the echo
    family: a word the model never wrote in any training target gets its (tied) output embedding pushed
    down by every softmax and cannot be copied later, e.g. a one-token city name in a tool call. A real LM
    has written every token of its vocabulary somewhere; echo gives the demo model the same."""
    words = {t[1:] if t.startswith("\u0120") else t for t in vocab}
    return sorted(w for w in words if w.isascii() and w.isalpha() and len(w) >= 2)


def use_vocab(vocab: list[str]) -> None:
    """Draw the word pools (TOKEN_WORDS, VOCAB_WORDS) from this tokenizer's tokens. They default to the
    shipped tokenizer's, which is what evaluation wants; data for a new tokenizer must use that one
    (train_demo.py prepare does), or the echo family teaches the words of the old vocabulary."""
    global TOKEN_WORDS, VOCAB_WORDS
    TOKEN_WORDS, VOCAB_WORDS = _token_words(vocab), _vocab_words(vocab)


TOKEN_WORDS: list[str] = []
VOCAB_WORDS: list[str] = []
use_vocab(vocab_of(SHIPPED_TOKENIZER))
_CONDITIONS = ["sunny", "cloudy", "rainy", "windy", "snowy", "foggy"]


def _city_split_key(city: str) -> str:
    return f"city:{city}"


def _gemma_value(v) -> str:
    """Gemma-4 tool-call argument syntax: unquoted keys, strings in <|"|> delimiters."""
    if isinstance(v, dict):
        return "{" + ",".join(f"{k}:{_gemma_value(x)}" for k, x in v.items()) + "}"
    if isinstance(v, list):
        return "[" + ",".join(_gemma_value(x) for x in v) + "]"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return str(v)
    return f"{STR}{v}{STR}"


def tool_call_text(name: str, args: dict) -> str:
    return f"<|tool_call>call:{name}{_gemma_value(args)}<tool_call|>"


_SYSTEMS = [None, "You are a helpful assistant.", "You can call tools."]


def _city(rng: random.Random) -> str:
    u = rng.random()
    if not TOKEN_WORDS:  # no shipped tokenizer to read: real and made-up names only
        return rng.choice(CITIES if u < 0.5 else SYNTHETIC_CITIES)
    return rng.choice(CITIES if u < 0.4 else SYNTHETIC_CITIES if u < 0.7 else TOKEN_WORDS)


def _tool_request(rng: random.Random):
    kind = rng.choice(["weather", "time", "add"])
    if kind == "weather":
        city = _city(rng)
        q = rng.choice(["What's the weather in {c}?", "what is the weather like in {c}?", "Is it raining in {c}?"])
        return kind, city, q.format(c=city), "get_weather", {"city": city}
    if kind == "time":
        city = _city(rng)
        q = rng.choice(["What time is it in {c}?", "what is the local time in {c}?"])
        return kind, city, q.format(c=city), "get_time", {"city": city}
    a, b = rng.randint(100, 9999), rng.randint(100, 9999)
    q = rng.choice(["Use the tool to add {a} and {b}.", "what is {a} + {b}? use add_numbers"])
    return kind, f"{a}:{b}", q.format(a=a, b=b), "add_numbers", {"a": a, "b": b}


def _messages_with_system(rng: random.Random, user_text: str) -> list:
    sys = rng.choice(_SYSTEMS)
    msgs = [] if sys is None else [{"role": "system", "content": sys}]
    return msgs + _user(user_text)


def tool_call(rng: random.Random) -> Example:
    kind, item, q, name, args = _tool_request(rng)
    target = tool_call_text(name, args) + TOOL_RESPONSE_OPEN
    key = _city_split_key(item) if kind != "add" else f"addtool:{item}"
    return Example("tool_call", key, _messages_with_system(rng, q), target, tools=TOOLS,
                   answer=tool_call_text(name, args), meta={"name": name, "args": args})


def tool_answer(rng: random.Random) -> Example:
    kind, item, q, name, args = _tool_request(rng)
    if kind == "weather":
        temp, cond = rng.randint(-10, 35), rng.choice(_CONDITIONS)
        response = {"temperature": temp, "condition": cond}
        ans = f"It is {temp} degrees and {cond} in {args['city']}."
    elif kind == "time":
        hh, mm = rng.randint(0, 23), rng.randint(0, 59)
        response = {"time": f"{hh:02d}:{mm:02d}"}
        ans = f"It is {hh:02d}:{mm:02d} in {args['city']}."
    else:
        response = {"result": args["a"] + args["b"]}
        ans = f"{args['a']} + {args['b']} = {args['a'] + args['b']}."
    msgs = _messages_with_system(rng, q) + [
        {"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": name, "arguments": args}}]},
        {"role": "tool", "name": name, "content": response},
    ]
    key = _city_split_key(item) if kind != "add" else f"addtool:{item}"
    return Example("tool_answer", key, msgs, ans + TURN_END, tools=TOOLS, answer=ans)


# ----------------------------------------------------------------------------------------------
# constraint tasks (bidirectional denoising shines: every output position constrains the others)

_OPEN_CLOSE = {"(": ")", "[": "]", "{": "}", "<": ">"}


def sort_task(rng: random.Random) -> Example:
    xs = [rng.randint(0, 99) for _ in range(rng.randint(3, 7))]
    q = rng.choice(["sort: {l}", "Sort these numbers: {l}", "sort ascending: {l}"])
    ans = " ".join(str(x) for x in sorted(xs))
    return Example("sort", "sort:" + ",".join(map(str, xs)), _user(q.format(l=" ".join(map(str, xs)))),
                   ans + TURN_END, answer=ans)


def brackets(rng: random.Random) -> Example:
    opens = [rng.choice("([{<") for _ in range(rng.randint(1, 7))]
    q = rng.choice(["close the brackets: {s}", "Balance: {s}"])
    ans = " ".join(_OPEN_CLOSE[o] for o in reversed(opens))
    return Example("brackets", "br:" + "".join(opens), _user(q.format(s=" ".join(opens))), ans + TURN_END, answer=ans)


def fillin(rng: random.Random) -> Example:
    if rng.random() < 0.5:
        start, step, n = rng.randint(0, 30), rng.randint(1, 9), rng.randint(4, 6)
        seq = [str(start + i * step) for i in range(n)]
        key = f"fillnum:{start}:{step}:{n}"
    else:
        i, n = rng.randint(0, 26 - 6), rng.randint(4, 6)
        seq = list(_LETTERS[i : i + n])
        key = f"fillabc:{i}:{n}"
    hole = rng.randrange(1, len(seq))
    ans = seq[hole]
    shown = seq[:hole] + ["_"] + seq[hole + 1 :]
    q = rng.choice(["fill in the blank: {s}", "What goes in the blank? {s}"])
    return Example("fillin", f"{key}:{hole}", _user(q.format(s=" ".join(shown))), ans + TURN_END, answer=ans)


_GREETINGS = ["hi", "hello", "Hello!", "hey", "who are you?", "Who are you?", "what can you do?", "help"]
GREETING_REPLY = ("Hello! I am a tiny DiffusionGemma demo model. I can do arithmetic, count, sort, "
                  "close brackets and call tools.")


def greet(rng: random.Random) -> Example:
    g = rng.choice(_GREETINGS)
    return Example("greet", f"greet:{g}", _user(g), GREETING_REPLY + TURN_END, answer=GREETING_REPLY)


def echo(rng: random.Random) -> Example:
    word = rng.choice(VOCAB_WORDS or CITIES)
    q = rng.choice(["Say the word {w}.", "Repeat this word: {w}", "echo {w}"])
    return Example("echo", f"echo:{word}", _user(q.format(w=word)), word + TURN_END, answer=word)


# ----------------------------------------------------------------------------------------------

FAMILIES = {
    "arith": arith, "facts": facts, "count": count, "think": think, "tool_call": tool_call,
    "tool_answer": tool_answer, "sort": sort_task, "brackets": brackets, "fillin": fillin, "greet": greet, "echo": echo,
}
# Sampling weights for training: the harder families get more of the budget.
WEIGHTS = {
    "arith": 3.0, "facts": 2.5, "count": 1.5, "think": 1.5, "tool_call": 3.0, "tool_answer": 2.0,
    "sort": 1.5, "brackets": 0.7, "fillin": 3.0, "greet": 0.1, "echo": 2.0,
}
# Earlier exchanges prepended to some training conversations, so a second chat turn is not out of
# distribution (the split is still decided by the last turn's item).
HISTORY_FAMILIES = ("arith", "facts", "sort", "brackets", "fillin", "greet")
EASY_FAMILIES = ("arith", "facts", "brackets", "fillin", "tool_call")
# Families whose held-out split can be empty of items (greetings are a fixed table) are evaluated on train items.
NO_HELDOUT = ("greet",)


def with_history(ex: Example, rng: random.Random, turns: int) -> Example:
    """ex with `turns` earlier user/model exchanges inserted before its conversation (after a system turn)."""
    history = []
    for _ in range(turns):
        prev = FAMILIES[rng.choice(HISTORY_FAMILIES)](rng)
        history += prev.messages[-1:] + [{"role": "assistant", "content": prev.answer}]
    msgs = ex.messages
    head = msgs[:1] if msgs and msgs[0]["role"] == "system" else []
    return Example(ex.family, ex.key, head + history + msgs[len(head):], ex.target, tools=ex.tools,
                   enable_thinking=ex.enable_thinking, answer=ex.answer, meta=ex.meta)


def generate(split: str, n: int, seed: int, families=None, history_prob: float = 0.0) -> list[Example]:
    """n examples of the given split ("train" or "heldout"), deterministic in seed.

    Rejection-samples on the split so both sets are drawn from the same distribution. With probability
    history_prob an example gets one or two earlier exchanges (multi-turn chats)."""
    fams = list(families or FAMILIES)
    weights = [WEIGHTS[f] for f in fams]
    rng = random.Random(seed)
    out: list[Example] = []
    tries = 0
    while len(out) < n:
        tries += 1
        if tries > 200 * n + 1000:
            raise RuntimeError(f"could not draw {n} {split} examples from {fams}")
        fam = rng.choices(fams, weights)[0]
        ex = FAMILIES[fam](rng)
        if ex.split == split or (fam in NO_HELDOUT and split == "heldout"):
            if history_prob and rng.random() < history_prob:
                ex = with_history(ex, rng, rng.randint(1, 2))
            out.append(ex)
    return out


def heldout_set(n_per_family: int, seed: int = 1234) -> list[Example]:
    """A fixed held-out evaluation set with n examples per family, de-duplicated by key."""
    out = []
    for fam in FAMILIES:
        seen, rng, tries = set(), random.Random(f"{seed}:{fam}"), 0
        while len([e for e in out if e.family == fam]) < n_per_family and tries < 100_000:
            tries += 1
            ex = FAMILIES[fam](rng)
            if ex.key in seen or (ex.split != "heldout" and fam not in NO_HELDOUT):
                continue
            seen.add(ex.key)
            out.append(ex)
    return out
