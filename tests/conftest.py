"""Session-wide test setup: import path, the Triton interpreter off CUDA, one torch thread, and seeded randomness.

Random inputs, and how to reproduce a failure
---------------------------------------------
Most tests draw fresh random inputs each run (torch's global generator, `random`, numpy). Each run has a session
seed: DGTEST_SEED if set, else a fresh one, printed in pytest's header. Before every test its own seed is
derived from the session seed and the test's id (tests/test_ops.py::test_x[param]) and torch, `random` and numpy
are seeded with it; a fixture wider than one test (a module's random model) is seeded from its own name the same
way, on a generator state of its own, so a test draws the same inputs whether it runs alone or in the whole suite.
A failing test's report has a "random seed" section; to re-run it with the same inputs:

    DGTEST_SEED=<session seed> python -m pytest -q 'tests/test_ops.py::test_x[param]'

Tests that seed themselves (torch.manual_seed, an explicit torch.Generator, a seed argument) keep doing exactly
what they did: the seeding here only fixes the state they would otherwise have found unseeded.
"""

import os
import random
import secrets
import sys
import zlib

import pytest
import torch

# Make tests/ importable (shared helpers such as tiny_checkpoints) without packaging it, and the repo root for the
# benchmarks' fixtures (bench.fixtures: random full-size weights).
sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Without a GPU, Triton kernels run in its interpreter. This must be set before the first
# `import triton` anywhere in the session, so it lives here rather than in one test module.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Test shapes are tiny: intra-op threads only spin, and on a busy 2-core machine that made some modules
# many times slower. One thread for the whole session (subprocess tests set their own).
torch.set_num_threads(1)

SEED_ENV = "DGTEST_SEED"  # not DIFFGEMMA_*: the package refuses DIFFGEMMA_ variables it does not know
SESSION_SEED = int(os.environ.get(SEED_ENV) or secrets.randbelow(2**31))

try:
    import numpy
except ImportError:  # numpy is optional here
    numpy = None


def derived_seed(*parts) -> int:
    """A seed in [0, 2^31) from the session seed and a name: stable across runs and machines (no hash())."""
    return zlib.crc32("\0".join(str(p) for p in (SESSION_SEED, *parts)).encode()) & 0x7FFFFFFF


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)  # the CPU generator and every CUDA device's
    if numpy is not None:
        numpy.random.seed(seed)


def _rng_state():
    return (random.getstate(), torch.random.get_rng_state(),
            torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
            numpy.random.get_state() if numpy is not None else None)


def _set_rng_state(state):
    py, cpu, cuda, np_state = state
    random.setstate(py)
    torch.random.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)
    if np_state is not None:
        numpy.random.set_state(np_state)


def pytest_report_header(config):
    return f"random inputs: {SEED_ENV}={SESSION_SEED} (set it to re-run with the same inputs)"


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    seed = derived_seed(item.nodeid)
    item.user_properties.append(("random_seed", seed))
    seed_everything(seed)


@pytest.hookimpl(hookwrapper=True)
def pytest_fixture_setup(fixturedef, request):
    """A module- or session-wide fixture draws from its own seed and leaves the test's generator state alone."""
    if fixturedef.scope == "function":
        yield
        return
    saved = _rng_state()
    param = getattr(request, "param", None)
    seed_everything(derived_seed(fixturedef.baseid, fixturedef.argname, param))
    try:
        yield
    finally:
        _set_rng_state(saved)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        report.sections.append((
            "random seed",
            f"test seed {derived_seed(item.nodeid)} (session seed {SESSION_SEED}); re-run with the same inputs:\n"
            f"  {SEED_ENV}={SESSION_SEED} python -m pytest -q '{item.nodeid}'"))
