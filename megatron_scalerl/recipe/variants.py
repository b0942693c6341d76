"""The recipe's variant sections: a choice among alternatives, each with its own described fields (a discriminated
union, as prime-rl types its variants). The name of each alternative has one owner, the `Literal` of its class's
tag field; the code that runs an alternative is keyed by its class (`algo/losses.OBJECTIVES`).

    algorithm.loss            {type: cispo, eps_max} | tis_reinforce {eps_max} | ppo_clip / dapo / gspo
                              {clip_low, clip_high}                                             (algo/losses.py)
    trainer.lr_schedule       {type: constant} | {type: cosine, min_lr}                         (trainer/step.py)
    algorithm.length_control  {mode: interruption, think_budget_min, ...} | {mode: length_penalty, penalty_max_len,
                              penalty_cache_len} | {mode: none}                          (algo/length_control.py)
    weight_sync.transport     {type: auto | nccl | gloo} | {type: disk, dir}     (weight_sync/generator_link.py)

Their rules across fields (a budget's ends, ppo_clip's symmetric clip) are in rules.py with the others.

How a variant section is read (`variant_union`):
- a bare name is the alternative of that name: `loss: dapo` reads as `loss: {type: dapo}`;
- a section may carry the fields of its other alternatives, which are dropped: the presets keep every
  alternative's values (recipes/scalerl.yaml is the home of every default), so `--set algorithm.loss=dapo` starts
  from the preset's clip_low and clip_high; the loaded recipe, and every RUN/recipe.yaml, holds the chosen one's;
- a bare name over a section keeps its fields (`recipe.loading.deep_merge`, `apply_overrides`: `switch_variant`).

The spellings before the sections existed load to the same recipe (`lift_flat_fields`): `algorithm.loss: cispo`
with `algorithm.eps_max` / `clip_low` / `clip_high` beside it, and `trainer.lr_schedule: cosine` with
`trainer.min_lr`; `--set algorithm.eps_max=5` is still the loss's eps_max.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal, Union, get_args, get_origin

from pydantic import BeforeValidator, Field

from megatron_scalerl.section import NonNegFloat, Pos, PosFloat, Section

VARIANT_KEY = "type"  # the tag field of a variant section (length_control's is `mode`, its name before the union)


class Variant(Section):
    """One alternative of a variant section; its tag field is a Literal of the alternative's name (or names)."""

    tag_key: ClassVar[str] = VARIANT_KEY

    @classmethod
    def tag(cls) -> str:
        """Its name (the default of its tag field; of an alternative that several names choose, the first)."""
        return cls.model_fields[cls.tag_key].default

    @classmethod
    def tags(cls) -> tuple[str, ...]:
        """Every name that chooses it (`weight_sync.transport`: auto, nccl and gloo choose the broadcast)."""
        return get_args(cls.model_fields[cls.tag_key].annotation)

    @classmethod
    def own_fields(cls) -> set[str]:
        return set(cls.model_fields) - {cls.tag_key}

    def params(self) -> dict[str, Any]:
        """Its own fields and their values (the tag apart)."""
        return self.model_dump(exclude={self.tag_key})


def variant_union(*classes: type[Variant]) -> Any:
    """The type of a variant section with alternatives `classes` (read as the module docstring says)."""
    key = classes[0].tag_key
    own = {tag: set(cls.model_fields) for cls in classes for tag in cls.tags()}
    every = set().union(*own.values())

    def read(value: Any) -> Any:
        if isinstance(value, str):
            return {key: value}
        if isinstance(value, dict) and value.get(key) in own:
            keep = own[value[key]]
            return {k: v for k, v in value.items() if k in keep or k not in every}
        return value

    return Annotated[Union[classes], BeforeValidator(read), Field(discriminator=key)]  # noqa: UP007


def union_variants(annotation: Any) -> tuple[type[Variant], ...]:
    """The alternatives of a variant section's type (empty for any other type)."""
    if get_origin(annotation) is Annotated:
        annotation = get_args(annotation)[0]
    members = get_args(annotation) if get_origin(annotation) is Union else ()
    return tuple(m for m in members if isinstance(m, type) and issubclass(m, Variant))


def switch_variant(old: Any, new: Any, tag_key: str | None) -> Any:
    """`new` over `old` when a preset or an override writes it at a key; `tag_key`: the tag field of the variant
    section the key holds (`type`, `mode`), None for any other key. A bare name over such a section is the section
    with its tag changed (the fields the new alternative does not take are dropped when it is read); otherwise
    `new`."""
    if tag_key is not None and isinstance(new, str) and isinstance(old, dict):
        return {**old, tag_key: new}
    return new


def respell_flat(fields: dict[str, Any]) -> dict[str, Any]:
    """Dotted fields (`recipe.flatten`) in the spelling before the variant sections, as they are spelled now
    (`algorithm.loss` -> `algorithm.loss.type`, `algorithm.eps_max` -> `algorithm.loss.eps_max`, `trainer.min_lr`
    -> `trainer.lr_schedule.min_lr`); a flat field wins over the section's own, as when a recipe is read
    (`lift_flat_fields`). For what older files recorded of a recipe (a sweep's base_recipe)."""
    out, flat = {}, {}
    for key, value in fields.items():
        respelled = key
        parent, _, name = key.rpartition(".")
        for section, names in FLAT_BEFORE.items():
            if key == section:
                respelled = f"{section}.{VARIANT_KEY}"
            elif parent == section.rpartition(".")[0] and name in names:
                respelled = f"{section}.{name}"
        (out if respelled == key else flat)[respelled] = value
    return {**out, **flat}


def lift_flat_fields(data: Any, section: str, names: set[str]) -> Any:
    """The spelling before a variant section existed: the fields `names`, set flat beside `section` (a bare name or
    a mapping), moved into it; a flat field wins over the section's own (it is a `--set` or a later file)."""
    if not isinstance(data, dict) or not names & set(data):
        return data
    out = dict(data)
    inner = out.get(section)
    inner = {VARIANT_KEY: inner} if isinstance(inner, str) else dict(inner or {})
    for name in names & set(data):
        inner[name] = out.pop(name)
    out[section] = inner
    return out


# --- algorithm.loss (algo/losses.py has the formulas) -----------------------------------------------------------

class _TruncatedIs(Variant):
    type: str = Field(description="the loss's name (each alternative's own Literal)")  # here: the tag comes first
    eps_max: Annotated[float, Field(gt=1)] = Field(
        description="cap on the importance ratio, sg(min(ratio, eps_max)) (ratio)")


class Cispo(_TruncatedIs):
    """ScaleRL's loss: sg(min(pi_train / pi_gen, eps_max)) * A * log pi_train."""

    type: Literal["cispo"] = Field("cispo", description="cispo: ScaleRL's truncated-IS REINFORCE (paper)")


class TisReinforce(_TruncatedIs):
    """REINFORCE with the weight sg(min(pi_old / pi_gen, eps_max)), fixed for the step."""

    type: Literal["tis_reinforce"] = Field(
        "tis_reinforce", description="tis_reinforce: REINFORCE with a truncated importance weight fixed per step")


class _ClippedRatio(Variant):
    type: str = Field(description="the loss's name (each alternative's own Literal)")  # here: the tag comes first
    clip_low: Annotated[float, Field(gt=0, lt=1)] = Field(description="the ratio's lower clip is 1 - clip_low (ratio)")
    clip_high: PosFloat = Field(description="the ratio's upper clip is 1 + clip_high (ratio; DAPO clip-higher: 0.26)")


class PpoClip(_ClippedRatio):
    """PPO's symmetric clipped ratio: clip_low == clip_high (recipe/rules.py)."""

    type: Literal["ppo_clip"] = Field("ppo_clip", description="ppo_clip: PPO's symmetric clipped ratio")


class Dapo(_ClippedRatio):
    """PPO's clipped ratio with clip-higher (clip_high > clip_low allowed)."""

    type: Literal["dapo"] = Field("dapo", description="dapo: the clipped ratio with clip-higher")


class Gspo(_ClippedRatio):
    """The clipped sequence ratio exp(mean_t log r_t) on every token of the sample."""

    type: Literal["gspo"] = Field("gspo", description="gspo: the clipped sequence-level ratio")


LOSS_VARIANTS = (Cispo, TisReinforce, PpoClip, Dapo, Gspo)
LossConfig = variant_union(*LOSS_VARIANTS)
LOSS_FIELDS = set().union(*(cls.own_fields() for cls in LOSS_VARIANTS))  # algorithm.<field> before the section


# --- trainer.lr_schedule (trainer/step.py) ------------------------------------------------------------------------

class ConstantSchedule(Variant):
    """lr after warm-up, to the end (the paper's)."""

    type: Literal["constant"] = Field("constant", description="constant: lr after warm-up to the end (paper)")


class CosineSchedule(Variant):
    """After warm-up a cosine from lr down to min_lr at trainer.max_steps."""

    type: Literal["cosine"] = Field("cosine", description="cosine: from lr down to min_lr at max_steps")
    min_lr: NonNegFloat = Field(description="where the cosine ends, at max_steps (dimensionless)")


LrSchedule = variant_union(ConstantSchedule, CosineSchedule)
LR_SCHEDULE_FIELDS = {"min_lr"}  # trainer.<field> before the section
FLAT_BEFORE = {"algorithm.loss": LOSS_FIELDS, "trainer.lr_schedule": LR_SCHEDULE_FIELDS}  # section: its flat fields


# --- algorithm.length_control (algo/length_control.py) -----------------------------------------------------------

class _LengthControl(Variant):
    tag_key: ClassVar[str] = "mode"


class Interruption(_LengthControl):
    """Force an end of thinking at a random budget, then let the answer follow (paper)."""

    mode: Literal["interruption"] = Field(
        "interruption", description="interruption: end thinking at a random budget (paper)")
    think_budget_min: Pos = Field(description="thinking budget's low end, uniform draw per sample (tokens; paper: 10k)")
    think_budget_max: Pos = Field(description="high end of the thinking budget (tokens; paper: 12k)")
    interruption_phrase: str = Field(
        description="text appended when thinking reaches its budget, closing </think>; out of the loss")
    phrase_token_reserve: Pos = Field(description="room kept for the interruption phrase itself (tokens)")
    answer_budget: Pos = Field(description="most tokens generated after the interruption phrase (tokens; paper: 2k)")


class LengthPenalty(_LengthControl):
    """DAPO's soft overlong penalty R_len = clip((L_max - |y|) / L_cache - 1, -1, 0) on correct answers."""

    mode: Literal["length_penalty"] = Field("length_penalty", description="length_penalty: DAPO-style soft penalty")
    penalty_max_len: Pos = Field(description="L_max of R_len = clip((L_max - |y|) / L_cache - 1, -1, 0) (tokens)")
    penalty_cache_len: Pos = Field(
        description="length penalty's L_cache: the ramp below L_max where correct answers lose reward (tokens)")


class NoLengthControl(_LengthControl):
    """The hard cap rollout.max_new_tokens alone."""

    mode: Literal["none"] = Field("none", description="none: the hard cap rollout.max_new_tokens alone")


LengthControl = variant_union(Interruption, LengthPenalty, NoLengthControl)


# --- weight_sync.transport (weight_sync/transport.py builds the transports; generator_link.py reads this) ----------

class BroadcastTransportConfig(Variant):
    """The weights broadcast over one process group per sender (weight_sync/broadcast.py)."""

    type: Literal["auto", "nccl", "gloo"] = Field(
        "auto", description="auto (nccl with CUDA, else gloo), nccl or gloo: a broadcast over process groups")


class DiskTransportConfig(Variant):
    """Each sender writes its buckets as safetensors files and the generators read them (weight_sync/disk.py), for
    generators the trainer cannot reach over a process group."""

    type: Literal["disk"] = Field("disk", description="disk: safetensors files on a filesystem both ends mount")
    dir: str | None = Field(
        None, description="the folder the senders write under, on a filesystem the generators mount too (path); "
                          "null: RUN/weight_sync")


TransportConfig = variant_union(BroadcastTransportConfig, DiskTransportConfig)

