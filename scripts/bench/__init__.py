"""Benchmarks: Weir against Hugging Face transformers and vLLM's CPU build (``serving``,
``offline``, ``structured``, ``replay``, ``aiperf``), the executor's step alone (``step``),
start-up (``startup``), and the scheduler's and admission's choices on traces (``admission``,
``chunking``, ``cost_model``, ``fairness``, ``knee``, ``simulate``). Run one with
``scripts/run bench/<name> --help``."""
