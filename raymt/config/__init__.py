"""Typed configuration: the one home of every default, presets and `--set` overrides.

- `corpus`: the built-in languages, `CorpusSpec`, the checks of a corpus list,
  corpora from tables and from the input flags' SPECs (`corpora_from_flags`, `split_spec`,
  `parse_pairs`), and the one reader of older configs' one-pair fields (`with_one_pair`: only
  `raymt.flags.build_config` and `Config.from_dict` read them, so it is not re-exported)
- `sections`: the run's `Config` and its sections, `DecodeOptions`, `check_training`
- `commands`: `PrepareConfig` (`raymt data prepare`), `ScoreConfig` (`raymt data score`) and `BacktranslateConfig`,
  the last two with `ShardJobOptions` (a shard job's flags)
- `presets`: model presets as functions (tiny .. big)
- `overrides`: config files, `--set` values and older configs' field names
- `schedule`: the batch schedule and the defaults of GPU and compiled runs
- `serve`: the options of `raymt serve` (`ServeConfig`)

The names below are the package's: `from raymt.config import Config` wherever it is used.
"""

from raymt.config.commands import (
    BT_ENGINES,
    BT_FORMATS,
    CPU_ACTORS,
    BacktranslateConfig,
    PrepareConfig,
    ScoreConfig,
    ShardJobOptions,
    run_prepare_config,
)
from raymt.config.corpus import (
    BUILTIN_LANGS,
    CLEAN_KEYS,
    CONTENT_RULES,
    ORIGINS,
    SCORE_KEYS,
    TABLE_KEYS,
    CorpusSpec,
    check_corpora,
    check_real_weight,
    corpora_from_flags,
    corpora_from_tables,
    parse_pair,
    parse_pairs,
    split_spec,
)
from raymt.config.overrides import apply_overrides, flatten, load_file, parse_set_args, parse_value
from raymt.config.presets import PRESETS, base, big, mini, preset, small, tiny
from raymt.config.schedule import (
    GPU_EVAL_EVERY,
    GPU_MAX_STEPS,
    GPU_MAX_TOKENS,
    MAX_LR_SCALE,
    PAPER_BATCH_TOKENS,
    PAPER_WARMUP_STEPS,
    SCHEDULE_FIELDS,
    batch_schedule,
    device_defaults,
    global_batch_tokens,
    schedule_line,
)
from raymt.config.sections import (
    ACTIVATIONS,
    GPU_SHAPE_BUCKETS,
    RENAMED,
    SP_MODEL_TYPES,
    Config,
    CorpusOptions,
    DataConfig,
    DecodeOptions,
    ModelConfig,
    OptimConfig,
    TrainConfig,
    check_training,
)
from raymt.config.serve import SERVE_ENGINES, ServeConfig

__all__ = [
    "ACTIVATIONS",
    "BT_ENGINES",
    "BT_FORMATS",
    "BUILTIN_LANGS",
    "CPU_ACTORS",
    "GPU_EVAL_EVERY",
    "GPU_MAX_STEPS",
    "GPU_MAX_TOKENS",
    "GPU_SHAPE_BUCKETS",
    "MAX_LR_SCALE",
    "ORIGINS",
    "PAPER_BATCH_TOKENS",
    "PAPER_WARMUP_STEPS",
    "PRESETS",
    "RENAMED",
    "SCHEDULE_FIELDS",
    "SERVE_ENGINES",
    "SP_MODEL_TYPES",
    "TABLE_KEYS",
    "CLEAN_KEYS",
    "CONTENT_RULES",
    "SCORE_KEYS",
    "BacktranslateConfig",
    "ScoreConfig",
    "ShardJobOptions",
    "Config",
    "CorpusOptions",
    "CorpusSpec",
    "DataConfig",
    "DecodeOptions",
    "ModelConfig",
    "OptimConfig",
    "PrepareConfig",
    "ServeConfig",
    "TrainConfig",
    "apply_overrides",
    "base",
    "batch_schedule",
    "big",
    "check_corpora",
    "check_real_weight",
    "check_training",
    "corpora_from_flags",
    "corpora_from_tables",
    "device_defaults",
    "flatten",
    "global_batch_tokens",
    "load_file",
    "mini",
    "parse_pair",
    "parse_pairs",
    "parse_set_args",
    "parse_value",
    "preset",
    "run_prepare_config",
    "schedule_line",
    "small",
    "split_spec",
    "tiny",
]
