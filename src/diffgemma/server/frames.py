"""Canvas frames: the denoising canvas of a streamed chat completion, step by step, for front ends that draw it
(the playground page, server/playground/). The wire format is in docs/SERVING.md, 'Canvas frames'.

A request asks for them with `"diffgemma": {"frames": true}` beside its generation settings, on a plain stream
(`"stream": true`). Its job then gets `snapshot` as its `on_step` (worker.Job): on the worker thread, right after
the step's own status read, each StepEvent's canvas, accept mask and per-position entropy come to the host in one
read and are queued as a Frame. A request that does not ask gets no `on_step`: its steps are dropped on the worker,
their tensors never read, and its stream is what it would be without this module.

On the event loop, FrameStream turns each Frame, and each committed block (BlockEvent), into one more `data:` chunk
of the stream: a chat.completion.chunk with no choices (as a usage chunk is), the frame in its `diffgemma` object.
OpenAI clients parse it as a chunk with nothing in it, and code that skips chunks without choices skips it. It has
no SSE event name: some versions of the openai client turn a named event into an object without the chunk's fields.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass

import torch

from ..events import BlockEvent, StepEvent
from .errors import RequestError

FIELD = "frames"  # the request's diffgemma.frames
MILLI = 1000  # per-position entropies go as integers in thousandths of a nat (JSON writes ints fast)


def requested(body) -> bool:
    """Take `frames` out of a request body's `diffgemma` object (what stays there are generation settings) -> whether
    the request asks for frames. A body that is not an object, or has no `diffgemma` object, is left for the request
    parser to judge."""
    extra = body.get("diffgemma") if isinstance(body, dict) else None
    if not isinstance(extra, dict) or FIELD not in extra:
        return False
    want = extra[FIELD]
    body["diffgemma"] = {k: v for k, v in extra.items() if k != FIELD}
    if not isinstance(want, bool):
        raise RequestError(400, f"diffgemma.frames: expected true or false, got {want!r}", "diffgemma")
    if want and body.get("stream") is not True:
        raise RequestError(400, "diffgemma.frames: frames are chunks of a stream; send \"stream\": true with them",
                           "diffgemma")
    return want


@dataclass
class Frame:
    """One denoise step of one request, on the host."""

    block: int
    attempt: int
    step: int
    temperature: float
    mean_entropy: float
    stop_reason: str | None
    tokens: list[int]  # the step's argmax canvas
    accepted: list[int]  # the step's accept mask, 1 accepted, 0 renoised
    entropy: list[int] | None  # per-position entropy in thousandths of a nat, where the step carried it


_copy_streams: dict = {}


def _copy_stream(device: torch.device):
    """A CUDA stream of the frames' own on `device` (nothing else queues work on it); a no-op context elsewhere."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    if device not in _copy_streams:
        _copy_streams[device] = torch.cuda.Stream(device)
    return torch.cuda.stream(_copy_streams[device])


def snapshot(event: StepEvent) -> Frame:
    """A StepEvent -> its Frame: the canvas, the mask and the entropies (rounded to thousandths of a nat) stacked on
    the device as f64, which holds every token id exactly, and read in one copy.

    A StepEvent comes after its step's status read, a host wait that follows everything the step computed, so its
    tensors are complete: the read runs on a stream of its own and does not wait for what the step queued after the
    status (the self-conditioning input of the next step, a next forward launched ahead)."""
    with _copy_stream(event.draft.device):
        rows = [event.draft.to(torch.float64), event.accepted.to(torch.float64)]
        if event.entropy is not None:
            rows.append(torch.round(event.entropy.to(torch.float64) * MILLI))
        host = torch.stack(rows).cpu()
    return Frame(block=event.block, attempt=event.attempt, step=event.step, temperature=event.temperature,
                 mean_entropy=event.mean_entropy, stop_reason=event.stop_reason, tokens=host[0].long().tolist(),
                 accepted=host[1].long().tolist(), entropy=host[2].long().tolist() if len(rows) > 2 else None)


class FrameStream:
    """The frame chunks of one stream. `head()` -> the chunk a frame rides in (id, object, created, model, and the
    stream's `diffgemma` object); `settings`: the request's GenerationSettings (each step frame names its step
    budget and entropy bound)."""

    def __init__(self, tokenizer, settings, head):
        self.tokenizer, self.settings, self.head = tokenizer, settings, head
        self._pieces: dict[int, str] = {}

    def pieces(self, ids: list[int]) -> list[str]:
        """Each id's own text (special tokens as their text), decoded once per stream."""
        out = []
        for i in ids:
            piece = self._pieces.get(i)
            if piece is None:
                piece = self._pieces[i] = self.tokenizer.decode([i], skip_special_tokens=False)
            out.append(piece)
        return out

    def payload(self, event) -> dict | None:
        """A Frame -> a "step" frame, a BlockEvent -> a "commit" frame; anything else -> None."""
        if isinstance(event, Frame):
            s = self.settings
            out = {"type": "step", "block": event.block, "attempt": event.attempt, "step": event.step,
                   "max_steps": s.max_denoising_steps, "entropy_bound": s.entropy_bound,
                   "temperature": round(event.temperature, 6), "mean_entropy": round(event.mean_entropy, 6),
                   "stop_reason": event.stop_reason, "tokens": event.tokens, "pieces": self.pieces(event.tokens),
                   "accepted": event.accepted}
            if event.entropy is not None:
                out["entropy_milli"] = event.entropy
            return out
        if isinstance(event, BlockEvent):
            return {"type": "commit", "block": event.block, "tokens": event.tokens, "pieces": self.pieces(event.tokens),
                    "steps": event.steps, "attempts": event.attempts, "stop_reason": event.stop_reason,
                    "end": event.end}
        return None

    def sse(self, event) -> str | None:
        """The frame chunk (SSE text) for a Frame or a BlockEvent, or None for any other event."""
        frame = self.payload(event)
        if frame is None:
            return None
        data = self.head()
        data["diffgemma"] = dict(data.get("diffgemma") or {}, frame=frame)
        return f"data: {json.dumps(data, separators=(',', ':'))}\n\n"
