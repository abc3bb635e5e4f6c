"""Serving: an OpenAI-compatible HTTP API over one worker thread that owns the model and its KV slots, with an
op-log of every generation that `diffgemma replay` runs again.

  protocol.py    the chat-completions wire format: request checks, response objects
  reply_text.py  reply tokens -> the assistant message, whole or as streaming deltas
  worker.py      the thread that owns the model; KV slots reused by longest common prefix; cancellation
  oplog.py       the JSONL op-log: writer and reader
  replay.py      re-run a log and compare every event
  app.py         the FastAPI app (needs `pip install 'diffgemma[serve]'`)
"""
