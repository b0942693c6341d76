"""The recipe's `model` section, shared part: `SharedModelFields` (the fields every family reads) and `RopeScaling`.
Each family declares its own fields in its folder (`FamilySpec.fields`); `families.ModelConfig` is the two together.
Below `recipe` in the layer order (docs/design.md): families type against these classes."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from megatron_scalerl.families.hf import LLAMA3_ROPE, YARN_ROPE
from megatron_scalerl.section import NonNeg, NonNegFloat, Pos, PosFloat, Section


class RopeScaling(Section):
    """RoPE frequency scaling (HF `rope_scaling`): Llama-3 style (rope_type llama3, the default: a section written
    before YaRN existed has no rope_type) or YaRN (rope_type yarn: DeepSeek-V3), each with its own fields."""

    rope_type: Literal["llama3", "yarn"] = Field("llama3", description="llama3 or yarn (HF's rope_type; no unit)")
    factor: PosFloat = Field(description="times its original context the scaled RoPE covers (ratio; Llama-3.1: 8)")
    original_max_position_embeddings: Pos = Field(description="context the RoPE was trained for, unscaled (tokens)")
    low_freq_factor: PosFloat | None = Field(
        None, description="llama3: wavelengths above original_max_position_embeddings / this are divided by `factor` "
                          "(ratio)")
    high_freq_factor: PosFloat | None = Field(
        None, description="llama3: wavelengths below original_max_position_embeddings / this stay unscaled (ratio)")
    beta_fast: PosFloat | None = Field(
        None, description="yarn: rotations per original context above which a frequency is kept (count; HF: 32)")
    beta_slow: PosFloat | None = Field(
        None, description="yarn: rotations per original context below which a frequency is scaled (count; HF: 1)")
    mscale: NonNegFloat | None = Field(
        None, description="yarn: cos/sin scale 0.1 * mscale * ln(factor) + 1, its numerator (dimensionless)")
    mscale_all_dim: NonNegFloat | None = Field(
        None, description="yarn: that scale's denominator, squared into the softmax scale too (dimensionless; 0: none)")

    @model_validator(mode="after")
    def _fields_of_its_type(self) -> RopeScaling:
        own = {LLAMA3_ROPE: ("low_freq_factor", "high_freq_factor"),
               YARN_ROPE: ("beta_fast", "beta_slow", "mscale", "mscale_all_dim")}
        for kind, names in own.items():
            for name in names:
                if (getattr(self, name) is None) == (kind == self.rope_type):
                    state = "needs" if kind == self.rope_type else "takes no"
                    raise ValueError(f"rope_type {self.rope_type} {state} {name}")
        return self

    def hf_fields(self) -> dict[str, Any]:
        """The HF rope_parameters keys of this scaling (rope_theta apart)."""
        return self.model_dump(exclude_none=True)


class SharedModelFields(Section):
    """The model-section fields every family reads (`families.ModelConfig` adds each family's own)."""

    arch: str = Field(description="model family, families/<arch>/ (docs/model_families.md)")
    num_layers: Pos = Field(description="transformer layers (count)")
    hidden_size: Pos = Field(description="width of the residual stream (features per token)")
    ffn_hidden_size: Pos = Field(
        description="dense MLP intermediate size (features; Llama-4: HF intermediate_size_mlp)")
    num_attention_heads: Pos = Field(description="query heads per layer (count)")
    num_query_groups: Pos = Field(description="key/value heads per layer, GQA (count; divides num_attention_heads)")
    head_dim: Pos = Field(description="size of one attention head (features)")
    vocab_size: Pos = Field(
        description="tokenizer vocabulary (tokens); embedding and LM head are padded to a multiple of lcm(128, tp)")
    max_position_embeddings: Pos = Field(
        description="longest sequence the positions cover (tokens): prompt + completion fit inside")
    rope_theta: PosFloat = Field(description="RoPE base of the rotary frequencies (dimensionless)")
    rope_scaling: RopeScaling | None = Field(
        None, description="RoPE frequency scaling (HF rope_scaling): Llama-3 style, or YaRN (rope_type: yarn, "
                          "DeepSeek-V3); null: none")
    norm_eps: PosFloat = Field(description="epsilon inside RMSNorm's square root (dimensionless)")
    tie_word_embeddings: bool = Field(
        False, description="the LM head shares the input embedding's weights (HF tie_word_embeddings)")
    # MoE families (a dense model leaves them at their "off" values).
    num_experts: NonNeg = Field(0, description="routed experts per MoE layer (count); 0: a dense model")
    moe_ffn_hidden_size: Pos | None = Field(
        None, description="intermediate size of each expert and of Llama-4's shared expert (features); MoE only")
    moe_router_topk: Pos = Field(1, description="experts each token is routed to (count)")
    moe_layer_interval: Pos = Field(
        1, description="every N-th layer is MoE (layers; HF interleave_moe_layer_step / decoder_sparse_step)")
    moe_aux_loss_coeff: NonNegFloat = Field(
        0.0, description="weight of the router's load-balancing loss (dimensionless); 0: off, the RL default")

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0
