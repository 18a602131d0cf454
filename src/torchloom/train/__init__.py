"""The engine-agnostic per-rank training entry `run(cfg, run_dir, reporter)` and its parts."""
