// diffgemma playground: the live canvas and the stats panel, drawn from the stream's frame chunks
// (docs/SERVING.md, 'Canvas frames'). Loaded before app.js, which feeds them.
"use strict";

const $ = (id) => document.getElementById(id);

// ------------------------------------------------------------------------------------------ the canvas

const canvas = {
  cells: [],
  serial: 0, // frames drawn since the page opened

  size(n) {
    const box = $("canvas");
    while (this.cells.length < n) {
      const span = document.createElement("span");
      span.className = "cell";
      box.append(span);
      this.cells.push(span);
    }
    while (this.cells.length > n) this.cells.pop().remove();
  },

  // one denoise step: every position's draft token, accepted or renoised, its colour by confidence
  step(f) {
    this.bound = f.entropy_bound;
    this.size(f.tokens.length);
    let accepted = 0;
    for (let i = 0; i < f.tokens.length; i++) {
      const cell = this.cells[i];
      const ok = f.accepted[i] === 1;
      accepted += ok;
      setPiece(cell, f.pieces[i], ok ? "acc" : "noise");
      // confidence exp(-H): 1 for a sure position, towards 0 as its entropy grows
      const nats = f.entropy_milli ? f.entropy_milli[i] / 1000 : 0;
      cell.style.setProperty("--conf", Math.exp(-nats).toFixed(3));
    }
    const attempt = f.attempt ? ` (re-roll ${f.attempt})` : "";
    $("canvas-head").textContent =
      `block ${f.block + 1}${attempt} · step ${f.step}/${f.max_steps} · accepted ${accepted}/${f.tokens.length}` +
      ` · mean H ${f.mean_entropy.toFixed(3)} (bound ${f.entropy_bound}) · T ${f.temperature.toFixed(2)}`;
    this.mark();
  },

  // the block committed: its kept positions turn committed, positions trimmed after them fade out
  commit(f) {
    for (let i = 0; i < this.cells.length; i++) {
      if (i < f.tokens.length) setPiece(this.cells[i], f.pieces[i], "done");
      else this.cells[i].className = "cell trim";
    }
    $("canvas-head").textContent =
      `block ${f.block + 1} committed: ${f.tokens.length} tokens after ${f.steps} steps (${f.stop_reason})` +
      (this.bound === undefined ? "" : ` · entropy bound ${this.bound}`);
    this.mark();
  },

  mark() {
    this.serial += 1;
    $("canvas").dataset.frame = String(this.serial);
  },

  clear() {
    this.size(0);
    $("canvas-head").textContent = "No block yet.";
  },
};

function visiblePiece(piece) {
  if (piece === "") return "·";
  if (piece.trim() === "") return piece.replace(/ /g, "␣").replace(/\n/g, "⏎").replace(/\t/g, "⇥");
  return piece.replace(/\n/g, "⏎");
}

function setPiece(cell, piece, kind) {
  cell.textContent = visiblePiece(piece);
  const special = /^<[^<>]*>$/.test(piece) || /^<\|.*\|?>$/.test(piece);
  cell.className = `cell ${kind}${special ? " special" : ""}`;
}

// the live block's accepted positions, as the reply's faint preview
function previewText(f) {
  let out = "";
  for (let i = 0; i < f.tokens.length; i++) {
    if (f.accepted[i] !== 1) out += "·";
    else if (!/^<[^<>]*>$/.test(f.pieces[i])) out += f.pieces[i];
  }
  return out.replace(/·+$/, "").trimEnd();
}

// ------------------------------------------------------------------------------------------ stats

function setStat(name, value) {
  document.querySelector(`[data-stat="${name}"]`).textContent = value;
}

class Stats {
  constructor(framesOn) {
    this.t0 = performance.now();
    this.tFirst = null;
    this.framesOn = framesOn;
    this.steps = 0; // step frames: denoise forwards of this reply, re-rolls included
    this.blocks = 0;
    this.committed = 0;
    this.batch = { now: null, max: 0 };
    for (const name of ["tok_s", "tokens", "fwd_block", "ttfb", "blocks", "frames", "batch", "seed"]) {
      setStat(name, "–");
    }
    if (framesOn) setStat("frames", "0");
  }

  seconds() {
    return (performance.now() - this.t0) / 1000;
  }

  firstBlock() {
    if (this.tFirst === null) {
      this.tFirst = this.seconds();
      setStat("ttfb", `${this.tFirst.toFixed(2)} s`);
    }
  }

  step() {
    this.steps += 1;
    setStat("frames", String(this.steps + this.blocks));
  }

  commit(f) {
    this.blocks += 1;
    this.committed += f.tokens.length;
    this.firstBlock();
    setStat("blocks", String(this.blocks));
    setStat("frames", String(this.steps + this.blocks));
    setStat("fwd_block", (this.steps / this.blocks).toFixed(1));
    setStat("tok_s", (this.committed / this.seconds()).toFixed(1));
  }

  usage(u) {
    setStat("tokens", String(u.completion_tokens));
    setStat("tok_s", (u.completion_tokens / this.seconds()).toFixed(1));
  }

  seed(s) {
    if (s !== undefined) setStat("seed", String(s));
  }

  server(running) {
    this.batch.max = Math.max(this.batch.max, running);
    setStat("batch", `${running} running (max ${this.batch.max} this reply)`);
  }
}
