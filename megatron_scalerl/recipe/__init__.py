"""The run configuration: one typed, validated `Recipe`, composed from YAML presets and dotted overrides.

    schema.py   the typed sections (ParallelismConfig, ..., Recipe; the model section: families.ModelConfig): types and ranges, no defaults
                (those live in recipes/scalerl.yaml); slurm_minutes for the cluster's time limit
    sources.py  the data and evaluation sections: prompt sources, how their rows are read, asked and graded
                (RowFormat), local benchmarks
    variants.py the sections with alternatives, each with its own fields (algorithm.loss, trainer.lr_schedule,
                algorithm.length_control), and the readers of their spelling from before them
    loading.py  presets (recipes/*.yaml, recipes/models/*.yaml, `hf:DIR`), `--set` overrides, validation with the
                first bad field named (cross-field rules: rules.py), load_recipe; flatten / changed_fields /
                diff to compare recipes; preset_catalogue (the presets, for explain); load_run_recipe (a run's own
                RUN/recipe.yaml); require_init_from_matches (an HF trainer.init_from of the recipe's model)
    explain.py  what a key means, from the schema's descriptions, the presets and the rules' source (rule_reads.py):
                explain_key, key_table, annotate_yaml (`scalerl recipe explain`, `show --explain`), the nearest
                known keys to an unknown one

Everything else imports from here: `from megatron_scalerl.recipe import Recipe, load_recipe`.
"""

from megatron_scalerl.families import ModelConfig, RopeScaling
from megatron_scalerl.recipe.explain import annotate_yaml, explain_key, key_table, schema_keys
from megatron_scalerl.recipe.loading import (
    PRESET_DIR,
    apply_overrides,
    changed_fields,
    diff,
    flatten,
    load_recipe,
    load_run_recipe,
    model_config_from_hf,
    model_preset_names,
    parse_override,
    preset_catalogue,
    preset_names,
    read_hf_config,
    require_init_from_matches,
    resolve_dict,
    validate,
)
from megatron_scalerl.recipe.schema import (
    ClusterConfig,
    ForecastConfig,
    ParallelismConfig,
    Recipe,
    TrainerConfig,
    slurm_minutes,
)
from megatron_scalerl.recipe.sources import SHIPPED_BENCHMARKS, DataSource, EvalConfig, LocalBenchmark, benchmark_name

__all__ = [
    "PRESET_DIR",
    "ClusterConfig",
    "DataSource",
    "EvalConfig",
    "ForecastConfig",
    "LocalBenchmark",
    "ModelConfig",
    "ParallelismConfig",
    "Recipe",
    "RopeScaling",
    "SHIPPED_BENCHMARKS",
    "TrainerConfig",
    "annotate_yaml",
    "apply_overrides",
    "benchmark_name",
    "changed_fields",
    "diff",
    "explain_key",
    "flatten",
    "key_table",
    "load_recipe",
    "load_run_recipe",
    "model_config_from_hf",
    "model_preset_names",
    "parse_override",
    "preset_catalogue",
    "preset_names",
    "read_hf_config",
    "require_init_from_matches",
    "resolve_dict",
    "schema_keys",
    "slurm_minutes",
    "validate",
]
