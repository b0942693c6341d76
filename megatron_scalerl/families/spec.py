"""What a model family declares on its pure side: `FamilySpec`, and `LayerPlan` for what each decoder layer is.

Pure data and functions of the recipe's model section (no torch, no megatron-core; `families.ModelConfig` is named
for type checking only: it is composed of every family's `fields`). The family's torch side is
`models.family.ModelParts`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from megatron_scalerl.section import Section

if TYPE_CHECKING:
    from megatron_scalerl.families import ModelConfig


@dataclass(frozen=True)
class LayerPlan:
    """What one decoder layer computes beyond the block every family shares (RMSNorm, GQA attention, SwiGLU).

    Read by the HF config (`moe_layers`, `no_rope_layers`), the megatron-core config and layer specs, the weight
    mapping (which MLP table) and the memory plan (parameters, activations, attention scores)."""

    moe: bool  # routed experts (`model.num_experts`, top `moe_router_topk`) instead of the dense MLP
    rope: bool  # rotary position embedding on q and k; False: NoPE
    # on q and k, per head, before RoPE: "l2" a parameter-free L2 norm (Llama-4), "rms" an RMSNorm with a weight of
    # head_dim (Qwen3: HF q_norm / k_norm, megatron-core's qk_layernorm); None: none
    qk_norm: Literal["l2", "rms"] | None
    attention_chunk: int | None  # tokens: a query sees only its own chunk of the sequence; None: the whole prefix
    # MoE layers: shared experts beside the routed ones (count), megatron-core's one SwiGLU of this many times
    # `moe_ffn_hidden_size` (Llama-4: 1; DeepSeek-V3: `model.n_shared_experts`)
    shared_experts: int = 0
    # MoE layers: the router's weight scales each routed token before its expert (Llama-4); False: it scales the
    # expert's output
    expert_input_weighted: bool = False
    # MoE layers: the router chooses experts by score + a per-expert score-correction bias that RL does not train
    # (DeepSeek-V3: HF `e_score_correction_bias`, megatron-core's FP32 `router.expert_bias` buffer)
    router_expert_bias: bool = False
    # multi-latent attention (DeepSeek-V3: the model section's q_lora_rank ... v_head_dim) instead of GQA; its KV
    # cache holds a latent of kv_lora_rank + qk_rope_head_dim features per token
    latent_attention: bool = False


@dataclass(frozen=True)
class FamilySpec:
    """One model family's pure side: `FAMILY` in `families/<name>/__init__.py` (docs/model_families.md).

    `name` is the recipe's `model.arch` and the folder's name. The HF translation is split: `families.hf` holds the
    config.json keys every family shares, `hf_fields` / `model_fields` the family's own, one per direction."""

    name: str
    hf_architecture: str  # config.json `architectures[0]`, e.g. LlamaForCausalLM
    hf_model_type: str  # config.json `model_type` of the text model, e.g. llama; how a checkpoint names its family
    moe: bool  # whether the family has routed experts (model.num_experts > 0 is refused otherwise)
    layer: Callable[[ModelConfig, int], LayerPlan]  # (model section, global 0-based layer) -> what that layer is
    hf_fields: Callable[[ModelConfig], dict[str, Any]]  # model section -> the family's own config.json keys
    # (config.json, its path for errors) -> the family's own model-section fields; raises UserError on what our
    # models do not compute
    model_fields: Callable[[dict[str, Any], str], dict[str, Any]]
    # model section -> (field, why) for each setting the family's models cannot compute (checked when a recipe loads)
    model_problems: Callable[[ModelConfig], list[tuple[str, str]]] | None = None
    # the model-section fields this family reads beyond the shared ones (`families.model_section`), declared in its
    # folder with their descriptions and defaults; a model of another family that sets one away from its default is
    # refused, naming the field and the family that reads it. None: the shared fields alone
    fields: type[Section] | None = None
    # Serving: (config.json, vLLM's default KV block in tokens) -> the KV block vLLM must use instead, or None for
    # the default. None: the default always fits the family.
    kv_block_size: Callable[[dict[str, Any], int], int | None] | None = None
    # Serving: config.json -> the generation settings vLLM must be given (`--override-generation-config`) to compute
    # what the trainer computes; None: none.
    generation_overrides: Callable[[dict[str, Any]], dict[str, Any]] | None = None
    # the HF rope_type values the family's models compute: "default" (no scaling), "llama3", "yarn"; a recipe whose
    # `model.rope_scaling` is another is refused when it loads
    rope_types: tuple[str, ...] = ("default", "llama3")

    @property
    def own_fields(self) -> tuple[str, ...]:
        """The names of the family's own model-section fields (`fields`)."""
        return tuple(self.fields.model_fields) if self.fields else ()
