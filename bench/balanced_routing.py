"""Balanced MoE routing for benchmarks on random weights.

Random weights route a canvas unlike a trained model: on the full-size random engine the 256 x 8 canvas routes
reach only ~99 of the 128 experts per layer (bench_routing.py, H200, 2026-11-30), so a step reads ~3/4 of the
expert bytes and looks ~3 ms faster than the real model's step, which touches every expert (issue 5). With
balanced routing, route (t, j) goes to expert (k·t + j) mod E: every expert gets T·k/E rows and every expert
weight is read, the case the roofline describes. The router itself still runs, so its cost stays in the step;
only the expert ids it picked are replaced (the mixing weights are kept).

  routing("balanced" | "model")   context manager: patches the engine's router for everything run inside
                                  (captured CUDA graphs keep the function they were captured with: clear
                                  engine._graphs when switching)
  balance_hf(model)               the same for transformers' DiffusionGemma (forward hooks on its routers)
"""

from __future__ import annotations

import contextlib

import torch

import diffgemma.model.forward as forward_module

MODEL_ROUTE = forward_module.route_fused
KINDS = ("balanced", "model")


def balanced_ids(T: int, k: int, E: int, device, dtype=torch.int64) -> torch.Tensor:
    """[T, k] expert ids: row t holds k distinct experts, and each expert appears T·k/E times overall."""
    return (torch.arange(T * k, device=device) % E).view(T, k).to(dtype)


_IDS: dict = {}


def balanced_route(router_in, router_w, k, per_expert_scale, **kw):
    """The model's router runs (its cost stays in the step); its expert ids are replaced by balanced ones.

    The ids are a constant made once per shape, not recomputed in every layer: the arange, remainder and cast
    (~90 small kernels a step) would otherwise be timed as part of the engine's step, a cost the real model does
    not have."""
    weights, experts = MODEL_ROUTE(router_in, router_w, k, per_expert_scale, **kw)
    key = (experts.shape[0], k, router_w.shape[0], experts.device, experts.dtype)
    if key not in _IDS:
        _IDS[key] = balanced_ids(*key)
    return weights, _IDS[key]


@contextlib.contextmanager
def route_with(route):
    """The engine routes with `route` (same signature as route_fused) inside, with its own router after."""
    forward_module.route_fused = route
    try:
        yield
    finally:
        forward_module.route_fused = MODEL_ROUTE


@contextlib.contextmanager
def routing(kind: str):
    if kind not in KINDS:
        raise ValueError(f"routing: expected one of {KINDS}, got {kind!r}")
    with route_with(balanced_route if kind == "balanced" else MODEL_ROUTE):
        yield


def balance_hf(model) -> list:
    """Forward hooks that give every transformers DiffusionGemma router balanced expert ids; returns the handles."""

    def hook(module, args, output):
        probs, weights, index = output
        E = probs.shape[-1]
        return probs, weights, balanced_ids(index.shape[0], index.shape[1], E, index.device, index.dtype)

    return [m.register_forward_hook(hook) for m in model.modules() if type(m).__name__.endswith("TextRouter")]
