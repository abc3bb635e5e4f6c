"""The canvas RNG: the contract's 64-bit LCG, and the maps from its draws to token ids.

docs/ARCHITECTURE.md, 'Generation contract' (`seed`): state = state * 6966169279 + 1039523323 (mod 2**64), a draw is the HIGH 32 bits
of the new state, and a generator seeded with `seed` starts at state = seed + 1. Being a fixed integer
recurrence it gives identical noise on every device and in every process, unlike torch's generators.

Draws are vectorised with the jump-ahead form of the recurrence: after n steps
    state_n = A_n * state_0 + C_n   with  A_n = a**n,  C_n = c * (a**(n-1) + ... + a + 1)   (mod 2**64),
so n draws are one multiply-add over precomputed (A_n, C_n) tables instead of a Python loop.
`next_u32` is the one-at-a-time twin the tests pin the vectorised path to.
"""

from __future__ import annotations

import numpy as np
import torch

LCG_MULTIPLIER = 6966169279
LCG_INCREMENT = 1039523323
_MASK64 = (1 << 64) - 1

_tables_a = np.ones(1, dtype=np.uint64)  # A_0 .. A_n  (index n)
_tables_c = np.zeros(1, dtype=np.uint64)  # C_0 .. C_n


def _jump_tables(n: int) -> tuple[np.ndarray, np.ndarray]:
    """(A_1..A_n, C_1..C_n) as uint64 arrays; grown on demand and cached."""
    global _tables_a, _tables_c
    have = len(_tables_a) - 1
    if have < n:
        a_list = [int(_tables_a[-1])]
        c_list = [int(_tables_c[-1])]
        for _ in range(have, n):
            a_list.append((a_list[-1] * LCG_MULTIPLIER) & _MASK64)
            c_list.append((c_list[-1] * LCG_MULTIPLIER + LCG_INCREMENT) & _MASK64)
        _tables_a = np.concatenate([_tables_a, np.array(a_list[1:], dtype=np.uint64)])
        _tables_c = np.concatenate([_tables_c, np.array(c_list[1:], dtype=np.uint64)])
    return _tables_a[1 : n + 1], _tables_c[1 : n + 1]


class Lcg:
    """Seeded 64-bit LCG. `state` is a plain int in [0, 2**64)."""

    def __init__(self, seed: int):
        self.state = (int(seed) + 1) & _MASK64

    def next_u32(self) -> int:
        """One draw: advance the state, return its high 32 bits (the slow reference path)."""
        self.state = (self.state * LCG_MULTIPLIER + LCG_INCREMENT) & _MASK64
        return self.state >> 32

    def u32(self, n: int) -> np.ndarray:
        """The next n draws (uint64 array holding 32-bit values), advancing the state by n."""
        if n <= 0:
            return np.zeros(0, dtype=np.uint64)
        a, c = _jump_tables(n)
        states = a * np.uint64(self.state) + c  # uint64 array arithmetic wraps mod 2**64
        self.state = int(states[-1])
        return states >> np.uint64(32)

    def uniform(self, n: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """n uniforms in [0, 1) as float64: draw / 2**32."""
        return torch.from_numpy(self.u32(n).astype(np.float64) / 4294967296.0).to(device)

    def randint(self, n: int, high: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """n token ids uniform in [0, high): floor(draw * high / 2**32), exact in integer arithmetic."""
        if not 1 <= high <= 1 << 32:
            raise ValueError(f"randint: high={high} must be in [1, 2**32]")
        ids = (self.u32(n) * np.uint64(high)) >> np.uint64(32)
        return torch.from_numpy(ids.astype(np.int64)).to(device)


def block_seed(seed: int, block: int, attempt: int) -> int:
    """The contract re-seeds the canvas RNG per block (§7) and per re-roll (§6 guard).

    Block 0, attempt 0 is `seed` itself; other (block, attempt) pairs are spread with two odd 64-bit
    constants so neighbouring seeds do not share streams.
    """
    return (int(seed) + 0x9E3779B97F4A7C15 * block + 0xD1B54A32D192ED03 * attempt) & _MASK64


def categorical(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One draw per row of `probs` [R, V] by inverse CDF with the given uniforms [R] in [0, 1).

    Row i picks the first index whose cumulative probability exceeds u_i * (row total), so a
    zero-probability token is never picked and the draw is a pure function of (probs, u).
    """
    cdf = probs.to(torch.float64).cumsum(dim=-1)
    target = uniforms.to(device=cdf.device, dtype=torch.float64) * cdf[:, -1]
    idx = torch.searchsorted(cdf, target[:, None], right=True).squeeze(-1)
    return idx.clamp_(max=probs.shape[-1] - 1)


_device_tables: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}


def _tables_on(device: torch.device, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(A_1..A_n, C_1..C_n) as int64 tensors on `device` (the uint64 bits reinterpreted), cached per device.

    Copied to the device once per size increase (a block-level event), never per step.
    """
    key = str(device)
    have = _device_tables.get(key)
    if have is None or len(have[0]) < n:
        size = max(n, 256 if have is None else 2 * len(have[0]))
        a, c = _jump_tables(size)
        have = (torch.from_numpy(a.view(np.int64).copy()).to(device), torch.from_numpy(c.view(np.int64).copy()).to(device))
        _device_tables[key] = have
    return have[0][:n], have[1][:n]


class DeviceLcg:
    """The same LCG as `Lcg`, with its state in a 0-d int64 tensor on `device`: draws never leave the device.

    int64 multiply/add wrap mod 2**64 exactly like the uint64 recurrence (the low 64 bits of a product do
    not depend on signedness), so every draw is bit-identical to `Lcg`'s. Reading `state` syncs; the
    generation loop never does.
    """

    def __init__(self, seed: int, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        start = (int(seed) + 1) & _MASK64
        # a fill, not a host->device copy (a copy from pageable memory would sync)
        self._state = torch.full((), start - (1 << 64) if start >= 1 << 63 else start, dtype=torch.int64,
                                 device=self.device)

    @property
    def state(self) -> int:
        return int(self._state) & _MASK64

    def u32(self, n: int) -> torch.Tensor:
        """The next n draws as an int64 tensor of 32-bit values, advancing the state by n."""
        if n <= 0:
            return torch.zeros(0, dtype=torch.int64, device=self.device)
        a, c = _tables_on(self.device, n)
        states = a * self._state + c
        # In place, never a fresh tensor: generate draws on two streams (the canvas on the main one, the noise on its
        # side stream), and a replaced state would go back to the stream that allocated it while the other stream's
        # read of it is still queued; that stream's next allocation could then overwrite it first, and seeded runs
        # would differ (docs/ARCHITECTURE.md, 'Overlap').
        self._state.copy_(states[-1])
        return (states >> 32) & 0xFFFFFFFF

    def uniform(self, n: int, device=None) -> torch.Tensor:
        """n uniforms in [0, 1) as float64: draw / 2**32 (exact)."""
        return self.u32(n).double() / 4294967296.0

    def randint(self, n: int, high: int, device=None) -> torch.Tensor:
        """n ids uniform in [0, high): floor(draw * high / 2**32). draw * high < 2**64, so the wrapped int64
        product holds its exact bits and the high word, masked, is the quotient."""
        if not 1 <= high <= 1 << 32:
            raise ValueError(f"randint: high={high} must be in [1, 2**32]")
        return ((self.u32(n) * high) >> 32) & 0xFFFFFFFF
