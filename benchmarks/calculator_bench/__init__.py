"""The calculator benchmark (``benchmarks/bench_calculator.py``), by concern: ``common`` (constants), ``corpus``,
``workers`` (the measurements, in subprocesses), ``runner`` (the parent), ``report``."""
