"""Build the demo model's tokenizer: byte-level BPE trained with `tokenizers` on the demo data.

Id layout (kept identical to the real Gemma-4 checkpoint where the engine depends on it):
  0 <pad>   1 <eos>   2 <bos>   3 <unk>   4 <mask>
  46 <|tool>  47 <tool|>  48 <|tool_call>  49 <tool_call|>  50 <|tool_response>  51 <tool_response|>  52 <|"|>
  98 <|think|>  100 <|channel>  101 <channel|>  105 <|turn>  106 <turn|>
  other ids below 107: <unused_N> placeholders;  107 .. V-2: the 256 byte symbols and the BPE merges
  V-1: <|filler|>, the filler sentinel (never in the data, so its logit stays low)
Stop ids for generation_config.json: eos 1, <turn|> 106, <|tool_response> 50 -- the same {1, 106, 50} as the real model.
Digits are split one per token (as Gemma does), so numbers are read and written digit by digit.

--isolate-spaces (the shipped tokenizer's setting since run 6): spaces become tokens of their own, so a word has the
same ids after a space as at the start of a string. Byte-level BPE otherwise gives " Dublin" (in the request)
and "Dublin" (inside a tool call's <|"|> delimiters) different ids, and copying an unseen one-token name into a
call becomes a per-word lookup the demo model cannot learn from examples (MODEL_CARD.md, known gaps). Changing
it changes every id: a model trained on one needs tools/remap_vocab.py and more training to use the other.

    python tools/build_tokenizer.py OUT_DIR [--vocab 2048] [--examples 60000] [--isolate-spaces]
writes OUT_DIR/tokenizer.json and OUT_DIR/tokenizer_config.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "src"))

import demo_data  # noqa: E402

FIXED = {
    0: "<pad>", 1: "<eos>", 2: "<bos>", 3: "<unk>", 4: "<mask>",
    46: "<|tool>", 47: "<tool|>", 48: "<|tool_call>", 49: "<tool_call|>", 50: "<|tool_response>",
    51: "<tool_response|>", 52: '<|"|>', 98: "<|think|>", 100: "<|channel>", 101: "<channel|>",
    105: "<|turn>", 106: "<turn|>",
}
N_RESERVED = 107
FILLER = "<|filler|>"
TEMPLATE_PATH = HERE.parent / "src" / "diffgemma" / "assets" / "demo" / "chat_template.jinja"


def reserved_tokens() -> list[str]:
    return [FIXED.get(i, f"<unused_{i}>") for i in range(N_RESERVED)]


def corpus(n: int, seed: int = 7):
    from diffgemma.tokenizer import render_chat

    template = TEMPLATE_PATH.read_text()
    for ex in demo_data.generate("train", n, seed):
        yield render_chat(template, ex.messages, tools=ex.tools, enable_thinking=ex.enable_thinking) + ex.target


def build(vocab_size: int = 2048, n_examples: int = 60000, isolate_spaces: bool = False):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    spaces = [pre_tokenizers.Split(" ", behavior="isolated")] if isolate_spaces else []
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        *spaces,
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - 1,  # the last id is the filler sentinel
        special_tokens=reserved_tokens(),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(n_examples), trainer=trainer)
    # Pad with unused ids if the data has fewer merges than asked, so the filler is exactly vocab_size-1.
    n = tok.get_vocab_size(with_added_tokens=True)
    if n < vocab_size - 1:
        tok.add_special_tokens([f"<unused_{i}>" for i in range(n, vocab_size - 1)])
    tok.add_special_tokens([FILLER])
    assert tok.get_vocab_size(with_added_tokens=True) == vocab_size, tok.get_vocab_size(with_added_tokens=True)
    for i, t in FIXED.items():
        assert tok.token_to_id(t) == i, (t, tok.token_to_id(t), i)
    assert tok.token_to_id(FILLER) == vocab_size - 1
    return tok


def tokenizer_config(vocab_size: int) -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 4096,
        "pad_token": "<pad>", "eos_token": "<eos>", "bos_token": "<bos>", "unk_token": "<unk>",
        "add_bos_token": False, "add_eos_token": False,  # the chat template writes <bos> itself
        "stop_tokens": ["<eos>", "<turn|>", "<|tool_response>"],
        "filler_token": FILLER, "vocab_size": vocab_size,
    }


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--examples", type=int, default=60000)
    ap.add_argument("--isolate-spaces", action="store_true", help="spaces as tokens of their own (see above)")
    args = ap.parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    tok = build(args.vocab, args.examples, args.isolate_spaces)
    tok.save(str(args.out_dir / "tokenizer.json"))
    (args.out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(args.vocab), indent=2) + "\n")
    print(f"wrote {args.out_dir}/tokenizer.json (vocab {tok.get_vocab_size()})")


if __name__ == "__main__":
    main()
