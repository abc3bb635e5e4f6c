"""Benchmarks and probes of the engine on the GPU (run as modules: python -m bench.bench_engine)."""
