"""`raymt pipeline`: from raw corpora to a deployed student in one resumable command (docs/pipeline.md).

config (the TOML file, typed), keys (each step's key, records and staleness), steps (each step an
existing command called through its typed config), models (export and comparison of the models,
which `raymt distill` shares), __main__ (the command: run, plan, show).
"""
