"""The run config: what to train. Typed, documented, parsed and validated once at the edge.

    schema.py     the typed sections (dataclasses; their field docs are `--help`), choices, coercion
    load.py       YAML + argv -> RunConfig, and `validate`: every problem at once (the one parser)
    rules.py      pure checks of the values (task x format, numbers, PEFT, generation, best checkpoint)
    sources.py    several weighted data sources (`datasets:`)
    preflight.py  what the values say about disk and environment (files, metrics offline, Hub token, output_dir)

The parallelism is *not* here: it is in the Accelerate config file given to ``accelerate launch``.
No module of this package imports torch: a bad file fails in well under a second, before any model loads.
"""

from finetune.config.load import (
    build_config,
    build_parser,
    load_yaml,
    parse,
    parse_cli_value,
    unknown_option_problems,
    validate,
)
from finetune.config.preflight import data_files, looks_local, previous_run_in
from finetune.config.rules import encoder_decoder_problems
from finetune.config.schema import (
    AUTO_CLASSES,
    CPU_ALLOCATORS,
    DATA_EXTENSIONS,
    DEFAULT_METRICS,
    DTYPES,
    FORMATS,
    GENERATION_METRICS,
    METHODS,
    MIXED_PRECISIONS,
    NESTED,
    NOT_IN_ROWS,
    PEFT_METHODS,
    PREFERENCE_METRICS,
    PROMPT_FORMATS,
    REFERENCE_METHODS,
    ROW_FIELDS,
    RUN_MARKERS,
    SECTIONS,
    SHIPPED_METRICS,
    TASK_FORMATS,
    TASKS,
    ConfigError,
    DataArgs,
    ModelArgs,
    PeftArgs,
    RunConfig,
    TrainArgs,
    all_fields,
    field_type,
    hub_repo_id,
    shipped_metrics,
)
from finetune.config.sources import SOURCE_FIELDS, Source, has_eval_data, sources_of

__all__ = [
    "AUTO_CLASSES",
    "CPU_ALLOCATORS",
    "DATA_EXTENSIONS",
    "DEFAULT_METRICS",
    "DTYPES",
    "FORMATS",
    "GENERATION_METRICS",
    "METHODS",
    "MIXED_PRECISIONS",
    "PROMPT_FORMATS",
    "PREFERENCE_METRICS",
    "REFERENCE_METHODS",
    "TASK_FORMATS",
    "NESTED",
    "NOT_IN_ROWS",
    "PEFT_METHODS",
    "ROW_FIELDS",
    "RUN_MARKERS",
    "SECTIONS",
    "SHIPPED_METRICS",
    "SOURCE_FIELDS",
    "TASKS",
    "ConfigError",
    "DataArgs",
    "ModelArgs",
    "PeftArgs",
    "RunConfig",
    "Source",
    "TrainArgs",
    "all_fields",
    "build_config",
    "build_parser",
    "parse",
    "unknown_option_problems",
    "data_files",
    "encoder_decoder_problems",
    "field_type",
    "has_eval_data",
    "hub_repo_id",
    "load_yaml",
    "looks_local",
    "parse_cli_value",
    "previous_run_in",
    "shipped_metrics",
    "sources_of",
    "validate",
]
