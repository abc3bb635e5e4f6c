"""Issue 55's mutants for tools/mutate.py: one-line bugs in the code added since the last audit (structured output,
tool calls, the chat template, reply parts, stop strings, serve's limits and images, vision, quant packs, settings,
replay's comparison, KV reuse and prompt chunks), each of the kind the issue says went unnoticed: a limit off by
one at its boundary, a branch the demo never takes, a comparison that skips a field, a default nobody exercises.

Each entry: (id, file, snippet, replacement, tests, what the bug stands for). tools/mutate.py makes them Mutants
of the group "issue55" (`python tools/mutate.py --group issue55 --merge`).
"""

SRV, Q, V = "src/diffgemma/server/", "src/diffgemma/quant/", "src/diffgemma/vision/"
CHK = ["tests/test_checked_replies.py"]
BND = ["tests/test_boundaries.py"]
TPL = ["tests/test_chat_template_parity.py", "tests/test_tokenizer.py"]
MARK = ["tests/test_reply_markup.py"]
RPL = ["tests/test_replay_tamper.py"]
QNT = ["tests/test_quant_tamper.py", "tests/test_quant_pack.py", "-k", "tamper or corrupted or alignment or stale"]
ENGB = ["tests/test_boundaries_engine.py"]
TOOLS = ["tests/test_session.py", "tests/test_checked_replies.py", "tests/test_openai_compat.py",
         "-k", "grammar or offered or forced or named or structured"]
SETS = ["tests/test_settings.py", "tests/test_boundaries.py", "-k", "settings or limit or Settings"]

NEW = [
    # -- structured output and forced tool calls (server/structured.py, server/app.py)
    ("retry-seed-plus-one", SRV + "structured.py", "settings.replace(seed=(settings.seed + k) % 2**64)",
     "settings.replace(seed=(settings.seed + 1) % 2**64)", CHK,
     "retries 3 and 4 reuse retry 2's seed (the same reply, written again)"),
    ("retry-one-fewer", SRV + "structured.py", "    for k in range(attempts):", "    for k in range(attempts - 1):",
     CHK, "one attempt fewer than FORMAT_ATTEMPTS"),
    ("retry-after-pass", SRV + "structured.py", "        if problem is None:\n            break",
     "        if problem is None and k:\n            break", CHK,
     "a reply passing its check at the first attempt is written again"),
    ("attempts-three", SRV + "structured.py", "FORMAT_ATTEMPTS = 4", "FORMAT_ATTEMPTS = 3", CHK,
     "the documented 4 attempts become 3"),
    ("named-plus-other", SRV + "structured.py", "any(c.name != forced_name for c in calls)",
     "all(c.name != forced_name for c in calls)", CHK,
     "a named tool_choice answered with the named call plus another is accepted"),
    ("json-object-list", SRV + "structured.py", "return None if isinstance(value, dict) else",
     "return None if isinstance(value, (dict, list)) else", CHK,
     "json_object accepts a JSON array"),
    ("forced-422-dropped", SRV + "app.py", "if problem is not None and (fmt is not None or forced):",
     "if problem is not None and fmt is not None:", CHK,
     "a forced tool call that never comes is answered 200 with text instead of a 422"),
    ("forced-one-attempt", SRV + "app.py",
     "attempts = structured.FORMAT_ATTEMPTS if fmt is not None or forced else retries + 1",
     "attempts = structured.FORMAT_ATTEMPTS if fmt is not None else retries + 1", CHK,
     "a forced tool call gets a single attempt"),
    ("unknown-function-ok", SRV + "structured.py", "    if name not in offered:\n",
     "    if name not in offered and arguments:\n", TOOLS,
     "a call to a function not offered, with no arguments, counts as a call"),
    # -- serve --limit and images (server/openai_fields.py, server/images.py)
    ("limit-at-refused", SRV + "openai_fields.py", "if value > cap and value != getattr(base, name):",
     "if value >= cap and value != getattr(base, name):", BND,
     "a request asking exactly its --limit is refused"),
    ("limit-retry-zero", SRV + "openai_fields.py", 'if changes[name] < (0 if name == "empty_reply_retry" else 1):',
     "if changes[name] < 1:", BND, "--limit empty_reply_retry=0 is refused"),
    ("limit-stop-count", SRV + "openai_fields.py", "if len(settings.stop_strings) > limits.stop_strings:",
     "if len(settings.stop_strings) >= limits.stop_strings:", BND, "exactly the allowed number of stop texts refused"),
    ("limit-stop-chars", SRV + "openai_fields.py", "if longest > limits.stop_string_chars:",
     "if longest > limits.stop_string_chars + 1:", BND, "a stop text one character over the limit is taken"),
    ("limit-canvas-at", SRV + "openai_fields.py", "settings.canvas_length > canvas_cap",
     "settings.canvas_length >= canvas_cap", BND, "a canvas of exactly the cap is refused"),
    ("images-at-limit", SRV + "images.py", "if n > limits.max_images:", "if n >= limits.max_images:", BND,
     "a request with exactly --max-images images is refused"),
    # -- vision
    ("vision-parts-at-limit", V + "prompt.py", "if max_images is not None and n > max_images:",
     "if max_images is not None and n >= max_images:", BND, "a message with exactly max_images images is refused"),
    ("vision-rescale-default", V + "config.py", "rescale_factor: float = 1 / 255", "rescale_factor: float = 1 / 256",
     BND, "a checkpoint without a processor config rescales by 1/256, not transformers' 1/255"),
    ("vision-soft-default", V + "config.py", "DEFAULT_MAX_SOFT_TOKENS = 280", "DEFAULT_MAX_SOFT_TOKENS = 560", BND,
     "the default soft-token budget is not transformers'"),
    ("vision-parts-aware", V + "prompt.py", 'parts_aware = "image" in template', "parts_aware = True",
     ["tests/test_vision_chat.py", "-k", "placeholder"], "a template without image parts gets content lists"),
    # -- the chat template (tokenizer.py)
    ("tpl-lstrip-off", "src/diffgemma/tokenizer.py", "trim_blocks=True, lstrip_blocks=True",
     "trim_blocks=True, lstrip_blocks=False", TPL, "block tags keep the indentation before them"),
    ("tpl-trim-off", "src/diffgemma/tokenizer.py", "trim_blocks=True, lstrip_blocks=True",
     "trim_blocks=False, lstrip_blocks=True", TPL, "the newline after a block tag is kept"),
    ("tpl-no-loopcontrols", "src/diffgemma/tokenizer.py", "extensions=[Generation, jinja2.ext.loopcontrols]",
     "extensions=[Generation]", TPL, "{% break %} / {% continue %} do not parse"),
    ("tpl-tojson-ascii", "src/diffgemma/tokenizer.py", "def _tojson(value, ensure_ascii=False,",
     "def _tojson(value, ensure_ascii=True,", TPL, "tojson escapes unicode by default"),
    ("tpl-tojson-sort", "src/diffgemma/tokenizer.py",
     "separators=separators, sort_keys=sort_keys)", "separators=separators, sort_keys=False)", TPL,
     "tojson ignores sort_keys"),
    ("tpl-none-kept", "src/diffgemma/tokenizer.py", "m = {k: v for k, v in message.items() if v is not None}",
     "m = dict(message)", TPL, "a message key whose value is None reaches the template"),
    ("tpl-reasoning-alias", "src/diffgemma/tokenizer.py",
     'm = {"thinking": reasoning, **m, "reasoning_content": reasoning}', 'm = {**m, "reasoning_content": reasoning}',
     TPL, "reasoning is not given under `thinking`"),
    ("tpl-named-tokens", "src/diffgemma/tokenizer.py",
     'if isinstance(value, str) and (key in SPECIAL_TOKEN_NAMES or key.endswith("_token")):',
     "if isinstance(value, str) and key in SPECIAL_TOKEN_NAMES:", TPL,
     "a config's other *_token texts are not template variables"),
    # -- reply parts (reply.py)
    ("reply-unopened-off", "src/diffgemma/reply.py", "cut = answer.find(CHANNEL_CLOSE) if thought is None else -1",
     "cut = -1", MARK, "a thought whose channel was never opened reaches the answer with its markup"),
    ("reply-late-as-early", "src/diffgemma/reply.py",
     "head = tokens if first_block is None else tokens[:first_block]", "head = tokens", MARK,
     "a close after the first block takes back text already shown"),
    # -- stop strings (stop_strings.py)
    ("stop-tie-shortest", "src/diffgemma/stop_strings.py", "(i == best[0] and len(s) > len(best[1]))",
     "(i == best[0] and len(s) < len(best[1]))", BND, "of two stops at the same place the shorter is reported"),
    ("stop-bisect-coarse", "src/diffgemma/stop_strings.py", "while hi - lo > 1:", "while hi - lo > 2:", BND,
     "the reply keeps a token past the one completing the stop"),
    ("stop-hold-short", "src/diffgemma/stop_strings.py", "for k in range(min(len(s) - 1, len(text)), n, -1):",
     "for k in range(min(len(s) - 2, len(text)), n, -1):", BND,
     "a stream shows the tail that the next block could complete into a stop"),
    # -- replay's comparison (replay.py)
    ("replay-skip-steps", "src/diffgemma/replay.py", '"block": ("block", "tokens", "steps", "stop_reason", "end")',
     '"block": ("block", "tokens", "stop_reason", "end")', RPL, "a block's step count is not compared"),
    ("replay-skip-stop-reason", "src/diffgemma/replay.py",
     '"block": ("block", "tokens", "steps", "stop_reason", "end")', '"block": ("block", "tokens", "steps", "end")',
     RPL, "a block's stop reason is not compared"),
    ("replay-skip-end", "src/diffgemma/replay.py", '"block": ("block", "tokens", "steps", "stop_reason", "end")',
     '"block": ("block", "tokens", "steps", "stop_reason")', RPL, "a block's end flag is not compared"),
    ("replay-skip-stop-token", "src/diffgemma/replay.py", '"done": ("tokens", "stop_token")', '"done": ("tokens",)',
     RPL, "the done record's stop token is not compared"),
    ("replay-common-length", "src/diffgemma/replay.py", "for k in range(max(len(logged), len(got))):",
     "for k in range(min(len(logged), len(got))):", RPL, "events past the shorter side (a stray event) are ignored"),
    # -- quant packs (quant/)
    ("blob-longer-ok", Q + "source.py", "if size != self.manifest.blob_bytes:", "if size < self.manifest.blob_bytes:",
     QNT, "a blob longer than its manifest is taken"),
    ("stale-size-only", Q + "externals.py", 'if size != ent.get("size") or sha != ent.get("header_sha256"):',
     'if sha != ent.get("header_sha256"):', QNT, "a source shard stale in its size only is taken"),
    ("stale-header-only", Q + "externals.py", 'if size != ent.get("size") or sha != ent.get("header_sha256"):',
     'if size != ent.get("size"):', QNT, "a source shard stale in its header only is taken"),
    ("local-align-16", Q + "pack.py", 'e.source["local_offset"] % ALIGN:', 'e.source["local_offset"] % 16:', QNT,
     "an overlay record at a local offset that is a multiple of 16, not 64, is taken"),
    ("blob-range-at-end", Q + "pack.py", "if a + e.nbytes > m.blob_bytes:", "if a + e.nbytes >= m.blob_bytes:", QNT,
     "a record ending exactly at the blob's end is refused"),
    # -- settings (settings.py)
    ("set-retry-zero", "src/diffgemma/settings.py", 'need(s.empty_reply_retry >= 0, "empty_reply_retry"',
     'need(s.empty_reply_retry >= 1, "empty_reply_retry"', SETS, "empty_reply_retry=0 (disabled) is refused"),
    ("set-trim-one", "src/diffgemma/settings.py", "need(0 <= s.confidence_trim <= 1,",
     "need(0 <= s.confidence_trim < 1,", SETS, "confidence_trim=1 is refused"),
    ("set-seed-top", "src/diffgemma/settings.py", "need(0 <= s.seed < 2**64,", "need(0 <= s.seed <= 2**64,", SETS,
     "a seed of 2**64 is taken"),
    # -- KV reuse and prompt chunks (model/engine_cache.py, slots.py, session.py)
    ("rewind-limit-strict", "src/diffgemma/model/engine_cache.py", ">= self.length - self.ring)",
     "> self.length - self.ring)", ENGB, "a rewind exactly to the ring's limit is refused (the prefix re-prefilled)"),
    ("usable-one-deeper", "src/diffgemma/slots.py", "rewind_to = min(n, len(ids) - 1)",
     "rewind_to = min(n, len(ids) - 1) + 1", ENGB, "a slot's usable prefix is judged one token shallower"),
    ("chunks-drop-last", "src/diffgemma/session.py", "return [ids[i:i + size] for i in range(0, len(ids), size)]",
     "return [ids[i:i + size] for i in range(0, len(ids) - 1, size)]", ENGB,
     "a prompt one token over a chunk loses its last token"),
]
