"""Serving: an OpenAI-compatible HTTP API over one worker thread that owns the model and its KV slots, with an
op-log of every generation (diffgemma/oplog.py) that `diffgemma replay` runs again (diffgemma/replay.py).

  protocol.py    the chat-completions wire format: request checks, response objects
  openai_fields.py  which OpenAI request fields are honoured, ignored or refused; limits on request settings
  structured.py  response_format and forced tool calls: checked replies, regenerated with a bumped seed
  errors.py      OpenAI's error object and RequestError; handlers.py sends every error in that shape
  reply_text.py  reply tokens -> the assistant message, whole or as streaming deltas
  worker.py      the thread that owns the model; KV slots reused by longest common prefix; cancellation
  app.py         the FastAPI app (needs `pip install 'diffgemma[serve]'`)
  prepare.py     a request body -> prompt ids (parse, checks, images, template, tokenizer), run off the event loop
  body_limit.py  the request body's size limit (413), enforced before the body is held
  text_limit.py  the most characters of text a context can hold, so longer text is refused before tokenizing
  commands.py    the `serve` and `replay` subcommands (their shared CLI helpers live in diffgemma/options.py)
"""
