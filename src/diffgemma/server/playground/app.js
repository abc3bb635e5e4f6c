// diffgemma playground: a chat over this server's /v1/chat/completions stream that draws the block being
// denoised from the stream's frame chunks (docs/SERVING.md, 'Canvas frames'; the drawing: canvas.js, loaded
// first). Plain JavaScript, no dependencies, nothing fetched from anywhere but this server.
"use strict";

const KEY_STORE = "diffgemma.apiKey"; // sessionStorage: this tab only

const state = {
  key: sessionStorage.getItem(KEY_STORE),
  info: null, // GET /playground/info
  messages: [], // the conversation in OpenAI's form
  pendingCalls: [], // tool calls of the last reply still waiting for their result
  images: [], // data: URLs attached to the next message
  abort: null, // the running request's AbortController
};

// ------------------------------------------------------------------------------------------ the server

function headers(json) {
  const h = json ? { "Content-Type": "application/json" } : {};
  if (state.key) h.Authorization = `Bearer ${state.key}`;
  return h;
}

// A request to this server; a 401 asks for the key (once, or again when it was refused) and retries.
async function call(path, init = {}) {
  for (;;) {
    const r = await fetch(path, { ...init, headers: headers(init.body !== undefined) });
    if (r.status !== 401) return r;
    await askKey(state.key !== null);
  }
}

function askKey(refused) {
  const dialog = $("key-dialog");
  $("key-error").hidden = !refused;
  $("key-input").value = "";
  return new Promise((resolve) => {
    dialog.addEventListener("close", () => {
      state.key = $("key-input").value.trim();
      sessionStorage.setItem(KEY_STORE, state.key);
      resolve();
    }, { once: true });
    dialog.showModal();
  });
}

async function errorText(r) {
  try {
    const body = await r.json();
    return body.error?.message || `HTTP ${r.status}`;
  } catch {
    return `HTTP ${r.status}`;
  }
}

// The data of each server-sent event of a streamed response, as text.
async function* sseData(response) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const data = [];
      for (const line of block.split("\n")) {
        if (line.startsWith("data:")) data.push(line.slice(5).replace(/^ /, ""));
      }
      if (data.length) yield data.join("\n");
    }
  }
}

// ------------------------------------------------------------------------------------------ settings

const NUMBER_SETTINGS = ["entropy_bound", "max_denoising_steps", "max_new_tokens"];

function fillSettings(defaults) {
  for (const name of NUMBER_SETTINGS) $(`set-${name}`).value = defaults[name];
  $("set-semantics").value = defaults.semantics;
  $("set-seed").placeholder = `server's (${defaults.seed})`;
}

// The request body's settings: only what differs from the server's own values is sent.
function requestSettings() {
  const defaults = state.info.settings;
  const body = { diffgemma: {} };
  for (const name of NUMBER_SETTINGS) {
    const value = Number($(`set-${name}`).value);
    if ($(`set-${name}`).value !== "" && value !== defaults[name]) {
      if (name === "max_new_tokens") body.max_tokens = value;
      else body.diffgemma[name] = value;
    }
  }
  if ($("set-semantics").value !== defaults.semantics) body.diffgemma.semantics = $("set-semantics").value;
  if ($("set-seed").value !== "") body.seed = Number($("set-seed").value);
  if ($("set-thinking").checked) body.chat_template_kwargs = { enable_thinking: true };
  if ($("set-frames").checked) body.diffgemma.frames = true;
  if ($("set-tools").checked && state.info.tools) body.tools = state.info.tools;
  if (!Object.keys(body.diffgemma).length) delete body.diffgemma;
  return body;
}

// ------------------------------------------------------------------------------------------ messages

function scrollChat() {
  const list = $("messages");
  list.scrollTop = list.scrollHeight;
}

function addMessage(role, text, images = []) {
  $("empty-hint").hidden = true;
  const li = document.createElement("li");
  li.className = `msg ${role}`;
  if (text) li.append(text);
  for (const url of images) {
    const img = document.createElement("img");
    img.src = url;
    img.alt = "attached image";
    li.append(img);
  }
  $("messages").append(li);
  scrollChat();
  return li;
}

// An assistant reply being written: its folded thought, its text (committed, then the live block's preview) and
// its tool calls.
class Reply {
  constructor() {
    this.el = addMessage("assistant", "");
    this.el.dataset.state = "streaming";
    this.thought = document.createElement("details");
    this.thought.className = "thought";
    this.thought.hidden = true;
    this.thought.innerHTML = "<summary>thought</summary>";
    this.thoughtText = document.createElement("div");
    this.thoughtText.className = "thought-text";
    this.thought.append(this.thoughtText);
    this.content = document.createElement("span");
    this.content.className = "content";
    this.ghost = document.createElement("span");
    this.ghost.className = "ghost";
    this.calls = document.createElement("div");
    this.el.append(this.thought, this.content, this.ghost, this.calls);
    this.text = "";
    this.reasoning = "";
    this.toolCalls = [];
  }

  delta(d) {
    if (d.reasoning_content) {
      this.reasoning += d.reasoning_content;
      this.thought.hidden = false;
      this.thoughtText.textContent = this.reasoning;
    }
    if (d.content) {
      this.text += d.content;
      const piece = document.createElement("span");
      piece.className = "settle"; // the committed block's text settles in where the preview was
      piece.textContent = d.content;
      this.content.append(piece);
    }
    for (const c of d.tool_calls || []) this.addCall(c);
    scrollChat();
  }

  addCall(c) {
    this.toolCalls.push(c);
    const box = document.createElement("div");
    box.className = "call";
    const name = document.createElement("span");
    name.className = "call-name";
    name.textContent = c.function.name;
    const args = document.createElement("dl");
    let parsed;
    try {
      parsed = JSON.parse(c.function.arguments);
    } catch {
      parsed = { arguments: c.function.arguments };
    }
    for (const [k, v] of Object.entries(parsed)) {
      const dt = document.createElement("dt");
      dt.textContent = k;
      const dd = document.createElement("dd");
      dd.textContent = JSON.stringify(v);
      args.append(dt, dd);
    }
    box.append(name, args);
    this.calls.append(box);
  }

  preview(text) {
    this.ghost.textContent = text;
    scrollChat();
  }

  error(message) {
    const p = document.createElement("div");
    p.className = "error-text";
    p.textContent = message;
    this.el.append(p);
    this.finish("error");
  }

  finish(how) {
    this.ghost.textContent = "";
    this.el.dataset.state = how;
  }

  // the message the conversation keeps (a stopped reply keeps what it had committed)
  message() {
    const m = { role: "assistant", content: this.text };
    if (this.toolCalls.length) {
      m.tool_calls = this.toolCalls.map(({ id, type, function: fn }) => ({ id, type, function: fn }));
    }
    return m;
  }
}

// The server's running requests, read from /metrics while a reply streams (where the server has /metrics).
function watchServer(stats) {
  if (!state.info.metrics) return () => {};
  let live = true;
  const poll = async () => {
    while (live) {
      try {
        const r = await call("/metrics");
        const m = /^diffgemma_requests_running\s+([0-9.e+]+)/m.exec(await r.text());
        if (m && live) stats.server(Number(m[1]));
      } catch {
        return;
      }
      await new Promise((done) => setTimeout(done, 500));
    }
  };
  poll();
  return () => { live = false; };
}

// ------------------------------------------------------------------------------------------ a turn

function busy(on) {
  $("send").hidden = on;
  $("stop").hidden = !on;
}

// One assistant turn over the conversation; a turn that fails cuts the conversation back to its first `sent`
// messages, so that what it sent is not repeated by the next send.
async function runTurn(sent) {
  const reply = new Reply();
  const conversation = state.messages; // Reset replaces it: a reply stopped by Reset is not kept
  const body = { messages: conversation, stream: true, stream_options: { include_usage: true },
                 ...requestSettings() };
  const stats = new Stats(Boolean(body.diffgemma?.frames));
  const stopWatching = watchServer(stats);
  state.abort = new AbortController();
  busy(true);
  try {
    const r = await call("/v1/chat/completions", { method: "POST", body: JSON.stringify(body),
                                                   signal: state.abort.signal });
    if (!r.ok) {
      reply.error(await errorText(r));
      conversation.splice(sent);
      return;
    }
    for await (const data of sseData(r)) {
      if (data === "[DONE]") break;
      const chunk = JSON.parse(data);
      if (chunk.error) {
        reply.error(chunk.error.message);
        conversation.splice(sent);
        return;
      }
      stats.seed(chunk.diffgemma?.seed);
      if (chunk.diffgemma?.frame) {
        onFrame(chunk.diffgemma.frame, reply, stats);
        continue;
      }
      if (chunk.usage) stats.usage(chunk.usage);
      for (const choice of chunk.choices || []) {
        if (choice.delta) {
          if (choice.delta.content || choice.delta.tool_calls) stats.firstBlock();
          reply.delta(choice.delta);
        }
        if (choice.finish_reason) reply.el.dataset.finish = choice.finish_reason;
      }
    }
    reply.finish("done");
  } catch (e) {
    if (e.name !== "AbortError") {
      reply.error(String(e));
      conversation.splice(sent);
      return;
    }
    reply.finish("stopped");
  } finally {
    stopWatching();
    state.abort = null;
    busy(false);
  }
  if (state.messages !== conversation) return;
  state.messages.push(reply.message());
  state.pendingCalls = [...reply.toolCalls];
  composerMode();
}

function onFrame(f, reply, stats) {
  if (f.type === "step") {
    canvas.step(f);
    stats.step();
    reply.preview(previewText(f));
  } else if (f.type === "commit") {
    canvas.commit(f);
    stats.commit(f);
    reply.preview("");
  }
}

// After a reply with tool calls, the composer takes each call's result in turn.
function composerMode() {
  const next = state.pendingCalls[0];
  $("prompt").placeholder = next
    ? `Result of ${next.function.name}(${next.function.arguments}), sent as the tool's answer`
    : "Message (Enter sends, Shift+Enter for a new line)";
}

async function send() {
  const text = $("prompt").value;
  if (state.abort || (!text.trim() && !state.images.length)) return;
  $("prompt").value = "";
  let sent = state.messages.length; // a failed turn takes the user's message back out; tool results stay
  if (state.pendingCalls.length) {
    const c = state.pendingCalls.shift();
    state.messages.push({ role: "tool", tool_call_id: c.id, content: text });
    addMessage("tool", text);
    composerMode();
    if (state.pendingCalls.length) return; // the next call's result first
    sent = state.messages.length;
  } else {
    const images = state.images.splice(0);
    renderAttachments();
    const content = images.length
      ? [{ type: "text", text }, ...images.map((url) => ({ type: "image_url", image_url: { url } }))]
      : text;
    state.messages.push({ role: "user", content });
    addMessage("user", text, images);
  }
  await runTurn(sent);
}

function reset() {
  if (state.abort) state.abort.abort();
  state.messages = [];
  state.pendingCalls = [];
  $("messages").replaceChildren();
  $("empty-hint").hidden = false;
  canvas.clear();
  composerMode();
}

// ------------------------------------------------------------------------------------------ images

function renderAttachments() {
  const box = $("attachments");
  box.replaceChildren();
  state.images.forEach((url, i) => {
    const fig = document.createElement("figure");
    const img = document.createElement("img");
    img.src = url;
    img.alt = "attached image";
    const drop = document.createElement("button");
    drop.type = "button";
    drop.textContent = "×";
    drop.title = "Remove";
    drop.addEventListener("click", () => {
      state.images.splice(i, 1);
      renderAttachments();
    });
    fig.append(img, drop);
    box.append(fig);
  });
}

function attach(files) {
  for (const file of files) {
    const reader = new FileReader();
    reader.addEventListener("load", () => {
      state.images.push(reader.result);
      renderAttachments();
    });
    reader.readAsDataURL(file);
  }
}

// ------------------------------------------------------------------------------------------ start

async function start() {
  $("composer").addEventListener("submit", (e) => {
    e.preventDefault();
    send();
  });
  $("prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      send();
    }
  });
  $("stop").addEventListener("click", () => state.abort?.abort());
  $("reset").addEventListener("click", reset);
  $("settings-toggle").addEventListener("click", () => {
    const open = $("settings").classList.toggle("open");
    $("settings-toggle").setAttribute("aria-expanded", String(open));
  });
  $("attach").addEventListener("change", (e) => {
    attach(e.target.files);
    e.target.value = "";
  });

  const r = await fetch("/playground/info");
  state.info = await r.json();
  if (state.info.key_required && !state.key) await askKey(false);
  fillSettings(state.info.settings);
  $("tools-row").hidden = !state.info.tools;
  $("attach-label").hidden = !state.info.vision;
  const models = await call("/v1/models");
  if (models.ok) $("model-name").textContent = (await models.json()).data[0]?.id ?? "";
  document.body.dataset.ready = "1";
}

start();
