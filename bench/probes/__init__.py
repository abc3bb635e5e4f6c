"""Probes: one-off investigations of where the engine's time and memory go (python -m bench.probes.probe_step)."""
