"""HF <-> Megatron parameter mapping: one table per model family (`ArchitectureMapping`, its `ModelParts.mapping`,
built from the rule groups below), the single source for every converter and for weight sync. Pure tensor logic;
nothing here touches process groups (see `models.weights` for that).

A `TensorRule` says how one Megatron parameter relates to one or more HF tensors:
  fuse   how the unsharded Megatron tensor is made from the HF tensors
           copy         the same tensor
           qkv          q_proj [heads*d, h], k_proj/v_proj [groups*d, h] -> linear_qkv [groups*(heads/groups+2)*d, h],
                        laid out per query group as [its q heads; k; v] (megatron's GQA layout)
           glu          gate_proj, up_proj [f, h] -> linear_fc1 [2f, h] = [gate; up]
           expert_glu   experts.gate_up_proj [E, h, 2f] (HF stores x @ W) -> expert e's linear_fc1 = W[e].T [2f, h]
           expert_down  experts.down_proj [E, f, h] -> expert e's linear_fc2 = W[e].T [h, f]
                        (experts HF keeps one tensor each, `{expert}` in their names, use copy and glu per expert)
           vocab        embed_tokens / lm_head [vocab, h] -> [padded_vocab_size(vocab, tp), h]: zero rows appended
                        (Megatron's padded vocabulary); to_hf drops them again
  split  how tensor parallelism shards the unsharded tensor
           none (replicated), dim0 (column-parallel, vocab-parallel), dim1 (row-parallel),
           glu  (each rank holds [its gate rows; its up rows], not a contiguous slice of [gate; up])
  group  tp (attention, dense MLP, shared expert, embeddings) or etp (routed experts: expert tensor parallelism)
Names: Megatron names are relative to GPTModel with `{layer}` the layer's index inside its pipeline stage and
`{expert}` the local expert index on this expert-parallel rank; HF names use the global `{layer}` index and, for
experts HF keeps one tensor each, the global `{expert}` index.
Routed expert e (global) lives on EP rank e // (E / ep) as local expert e % (E / ep).

Padded vocabulary: the embedding and the output layer have `padded_vocab_size(vocab_size, tp)` rows, so that any
vocabulary splits over any TP; the rows past `vocab_size` are padding (zero when loaded from HF, never a token id,
masked out of every softmax: `models.provider` for the model's logits, `trainer.logprobs` for the trainer's).
`ModelConfig.vocab_size` is always the true (HF) size.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from megatron_scalerl.families import layer_plan
from megatron_scalerl.models.family import model_parts
from megatron_scalerl.recipe import ModelConfig

Fuse = Literal["copy", "qkv", "glu", "expert_glu", "expert_down", "vocab"]
Split = Literal["none", "dim0", "dim1", "glu"]

# Megatron-LM's `make_vocab_size_divisible_by` default. A power of two, so the padded size is the same at every TP
# that divides it (1, 2, 4, ..., 128): a checkpoint's embedding keeps its global shape when resharded between them.
VOCAB_DIVISIBLE_BY = 128


def padded_vocab_size(vocab_size: int, tp: int, divisible_by: int = VOCAB_DIVISIBLE_BY) -> int:
    """Rows of the embedding / output layer: the smallest multiple of lcm(divisible_by, tp) >= vocab_size.

    Megatron-LM pads to a multiple of divisible_by * tp, which changes with TP (263 tokens: 384 rows at TP1, 512 at
    TP2) and so breaks resharding a checkpoint between those TPs; the lcm gives every tp dividing `divisible_by` the
    same padded size (263 -> 384 at TP1..TP128) and is still divisible by any other tp.
    """
    multiple = math.lcm(divisible_by, tp)
    return -(-vocab_size // multiple) * multiple


def real_vocab_rows(vocab_size: int, slice_start: int, slice_rows: int) -> int:
    """How many of a vocab slice's rows (global rows slice_start .. slice_start + slice_rows - 1 of the padded
    vocabulary) are tokens rather than padding: 0 .. slice_rows."""
    return min(max(vocab_size - slice_start, 0), slice_rows)


@dataclass(frozen=True)
class TensorRule:
    megatron: str
    hf: tuple[str, ...]
    fuse: Fuse = "copy"
    split: Split = "none"
    group: Literal["tp", "etp"] = "tp"

    @property
    def is_expert(self) -> bool:
        """A routed expert's tensor: one Megatron tensor per local expert."""
        return self.group == "etp"

    @property
    def per_expert(self) -> bool:
        """HF keeps one tensor per expert (`{expert}` in its names) rather than all experts stacked in one."""
        return "{expert}" in self.hf[0]


@dataclass(frozen=True)
class ArchitectureMapping:
    """The table of one model family: its per-layer rules (attention, dense MLP, MoE MLP: empty without experts);
    the model-level rules (embedding, final norm, LM head) are every family's. `attention` may be a function of the
    model section where the family's attention has optional parts (DeepSeek-V3's q low-rank projection)."""

    attention: tuple[TensorRule, ...] | Callable[[ModelConfig], tuple[TensorRule, ...]]
    dense_mlp: tuple[TensorRule, ...]
    moe_mlp: tuple[TensorRule, ...]


_L = "decoder.layers.{layer}."
HF_LAYER = "model.layers.{layer}."  # the HF name prefix of a decoder layer


def attention_rules(hf: str) -> tuple[TensorRule, ...]:
    """The attention half of a layer (its two norms included) whose HF names start with `hf` (e.g. HF_LAYER)."""
    return (
        TensorRule(_L + "input_layernorm.weight", (hf + "input_layernorm.weight",)),
        TensorRule(
            _L + "self_attention.linear_qkv.weight",
            tuple(f"{hf}self_attn.{p}_proj.weight" for p in "qkv"),
            fuse="qkv",
            split="dim0",
        ),
        TensorRule(_L + "self_attention.linear_proj.weight", (hf + "self_attn.o_proj.weight",), split="dim1"),
        TensorRule(_L + "pre_mlp_layernorm.weight", (hf + "post_attention_layernorm.weight",)),
    )


def latent_attention_rules(hf: str, *, q_lora: bool) -> tuple[TensorRule, ...]:
    """Multi-latent attention (DeepSeek-V3; its two norms included) whose HF names start with `hf`: q through
    q_a_proj [q_lora_rank, h], q_a_layernorm and q_b_proj [heads*(nope+rope), q_lora_rank] with `q_lora`, else
    q_proj; kv_a_proj_with_mqa [kv_lora_rank + rope, h] (the latent, then the shared RoPE key: megatron's order),
    kv_a_layernorm, kv_b_proj [heads*(nope+v), kv_lora_rank] (per head [k nope; v], as megatron's); o_proj.
    The down-projections and the latents' norms are whole on every TP rank (`platform.layer_backend`; TE names the
    norms `linear_*_up_proj.layer_norm_weight`: `TE_ALIASES`), the up-projections split by heads."""
    a, m = hf + "self_attn.", _L + "self_attention."
    if q_lora:
        query = (TensorRule(m + "linear_q_down_proj.weight", (a + "q_a_proj.weight",)),
                 TensorRule(m + "q_layernorm.weight", (a + "q_a_layernorm.weight",)),
                 TensorRule(m + "linear_q_up_proj.weight", (a + "q_b_proj.weight",), split="dim0"))
    else:
        query = (TensorRule(m + "linear_q_proj.weight", (a + "q_proj.weight",), split="dim0"),)
    return (
        TensorRule(_L + "input_layernorm.weight", (hf + "input_layernorm.weight",)),
        *query,
        TensorRule(m + "linear_kv_down_proj.weight", (a + "kv_a_proj_with_mqa.weight",)),
        TensorRule(m + "kv_layernorm.weight", (a + "kv_a_layernorm.weight",)),
        TensorRule(m + "linear_kv_up_proj.weight", (a + "kv_b_proj.weight",), split="dim0"),
        TensorRule(m + "linear_proj.weight", (a + "o_proj.weight",), split="dim1"),
        TensorRule(_L + "pre_mlp_layernorm.weight", (hf + "post_attention_layernorm.weight",)),
    )


def dense_mlp_rules(hf: str) -> tuple[TensorRule, ...]:
    """A SwiGLU MLP whose HF names start with `hf` (gate_proj, up_proj, down_proj)."""
    return (
        TensorRule(_L + "mlp.linear_fc1.weight", (hf + "gate_proj.weight", hf + "up_proj.weight"), "glu", "glu"),
        TensorRule(_L + "mlp.linear_fc2.weight", (hf + "down_proj.weight",), split="dim1"),
    )


def qk_norm_rules(hf: str) -> tuple[TensorRule, ...]:
    """The per-head RMSNorm weights of q and k [head_dim] (Qwen3), whose HF names start with `hf`."""
    return tuple(TensorRule(_L + f"self_attention.{p}_layernorm.weight", (f"{hf}self_attn.{p}_norm.weight",))
                 for p in "qk")


def router_rule(hf: str) -> TensorRule:
    """The router [num_experts, h] of a MoE layer, named `hf` in HF (e.g. `...feed_forward.router.weight`)."""
    return TensorRule(_L + "mlp.router.weight", (hf,))


# HF tensors kept in FP32 whatever the model's dtype (vLLM builds them FP32; conversion and weight sync keep them so,
# bit for bit): DeepSeek-V3's routing bias (`router_bias_rule`), a checkpoint tensor that picks experts and is never
# trained
KEPT_FP32_SUFFIXES = (".e_score_correction_bias",)


def kept_fp32(hf_name: str) -> bool:
    """Whether HF tensor `hf_name` stays FP32 whatever dtype the rest of the model is written or sent in."""
    return hf_name.endswith(KEPT_FP32_SUFFIXES)


def router_bias_rule(hf: str) -> TensorRule:
    """The router's score-correction bias [num_experts] (FP32; megatron's `router.expert_bias` buffer, which the
    trainer never updates: DeepSeek-V3's `mlp.gate.e_score_correction_bias`), named `hf` in HF (`KEPT_FP32_SUFFIXES`
    names its suffix)."""
    return TensorRule(_L + "mlp.router.expert_bias", (hf,))


_EXPERT = _L + "mlp.experts.local_experts.{expert}."


def stacked_expert_rules(hf: str) -> tuple[TensorRule, ...]:
    """Routed SwiGLU experts that HF stacks into two tensors, `hf` + gate_up_proj [E, h, 2f] and down_proj [E, f, h]
    (Llama-4)."""
    return (
        TensorRule(_EXPERT + "linear_fc1.weight", (hf + "gate_up_proj",), "expert_glu", "glu", "etp"),
        TensorRule(_EXPERT + "linear_fc2.weight", (hf + "down_proj",), "expert_down", "dim1", "etp"),
    )


def per_expert_rules(hf: str) -> tuple[TensorRule, ...]:
    """Routed SwiGLU experts that HF keeps one tensor each, `hf` with `{expert}` the global expert index, e.g.
    `...mlp.experts.{expert}.` + gate_proj / up_proj [f, h] and down_proj [h, f] (Qwen3-MoE)."""
    return (
        TensorRule(_EXPERT + "linear_fc1.weight", (hf + "gate_proj.weight", hf + "up_proj.weight"), "glu", "glu",
                   "etp"),
        TensorRule(_EXPERT + "linear_fc2.weight", (hf + "down_proj.weight",), split="dim1", group="etp"),
    )


def shared_expert_rules(hf: str) -> tuple[TensorRule, ...]:
    """A shared expert beside the routed ones, a SwiGLU MLP whose HF names start with `hf` (Llama-4)."""
    return (
        TensorRule(_L + "mlp.shared_experts.linear_fc1.weight", (hf + "gate_proj.weight", hf + "up_proj.weight"),
                   "glu", "glu"),
        TensorRule(_L + "mlp.shared_experts.linear_fc2.weight", (hf + "down_proj.weight",), split="dim1"),
    )


EMBEDDING = TensorRule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "vocab", "dim0")
FINAL_NORM = TensorRule("decoder.final_layernorm.weight", ("model.norm.weight",))
OUTPUT_LAYER = TensorRule("output_layer.weight", ("lm_head.weight",), "vocab", "dim0")
# Tied embeddings split over pipeline stages: the last stage keeps its own copy of the embedding as the LM head.
TIED_OUTPUT_LAYER = TensorRule("output_layer.weight", ("model.embed_tokens.weight",), "vocab", "dim0")

# Transformer Engine fuses the pre-attention / pre-MLP norms into the following linear layer.
TE_ALIASES = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
    # multi-latent attention: the latents' norms, fused into their up-projections
    "self_attention.q_layernorm.weight": "self_attention.linear_q_up_proj.layer_norm_weight",
    "self_attention.kv_layernorm.weight": "self_attention.linear_kv_up_proj.layer_norm_weight",
}


def layer_rules(model_cfg: ModelConfig, layer: int) -> tuple[TensorRule, ...]:
    """Rules of global 0-based `layer`."""
    table = model_parts(model_cfg).mapping
    attention = table.attention(model_cfg) if callable(table.attention) else table.attention
    return attention + (table.moe_mlp if layer_plan(model_cfg, layer).moe else table.dense_mlp)


def model_rules(model_cfg: ModelConfig, *, first_stage: bool, last_stage: bool) -> tuple[TensorRule, ...]:
    """Rules outside the decoder layers held by a stage (embedding first; final norm and LM head last).

    With tied embeddings the LM head is the embedding itself on a single stage, and a copy of it on the last
    stage of a pipeline (`TIED_OUTPUT_LAYER`, which exports nothing: the first stage exports the embedding).
    """
    rules: list[TensorRule] = []
    if first_stage:
        rules.append(EMBEDDING)
    if last_stage:
        rules.append(FINAL_NORM)
        if not model_cfg.tie_word_embeddings:
            rules.append(OUTPUT_LAYER)
        elif not first_stage:
            rules.append(TIED_OUTPUT_LAYER)
    return tuple(rules)


# ---- unsharded Megatron tensor <-> HF tensors ---------------------------------------------------------------------


def fuse_qkv(q: Tensor, k: Tensor, v: Tensor, model_cfg: ModelConfig) -> Tensor:
    groups, d = model_cfg.num_query_groups, model_cfg.head_dim
    per_group = model_cfg.num_attention_heads // groups
    hidden = q.shape[-1]
    fused = torch.cat(
        [q.reshape(groups, per_group * d, hidden), k.reshape(groups, d, hidden), v.reshape(groups, d, hidden)], 1
    )
    return fused.reshape(-1, hidden)


def split_qkv(fused: Tensor, model_cfg: ModelConfig) -> tuple[Tensor, Tensor, Tensor]:
    groups, d = model_cfg.num_query_groups, model_cfg.head_dim
    per_group = model_cfg.num_attention_heads // groups
    hidden = fused.shape[-1]
    q, k, v = fused.reshape(groups, (per_group + 2) * d, hidden).split([per_group * d, d, d], dim=1)
    return q.reshape(-1, hidden), k.reshape(-1, hidden), v.reshape(-1, hidden)


def to_megatron(
    rule: TensorRule, hf: list[Tensor], model_cfg: ModelConfig, *, tp: int, expert: int | None = None
) -> Tensor:
    """The unsharded Megatron tensor of `rule` from its HF tensors, to be split over `tp` ranks of the rule's group
    (`tp` sets the padded vocabulary of vocab rules; `expert`: global index, expert rules only)."""
    if rule.fuse == "copy":
        return hf[0]
    if rule.fuse == "vocab":
        rows = hf[0].shape[0]
        if rows != model_cfg.vocab_size:
            raise ValueError(f"{rule.hf[0]}: {rows} rows, but the model's vocab_size is {model_cfg.vocab_size}")
        padding = padded_vocab_size(rows, tp) - rows
        return torch.cat([hf[0], hf[0].new_zeros(padding, *hf[0].shape[1:])])
    if rule.fuse == "qkv":
        return fuse_qkv(hf[0], hf[1], hf[2], model_cfg)
    if rule.fuse == "glu":
        return torch.cat([hf[0], hf[1]], dim=0)
    assert expert is not None, f"{rule.megatron}: expert rules need the global expert index"
    return hf[0][expert].t().contiguous()


def to_hf(rule: TensorRule, full: Tensor | list[Tensor], model_cfg: ModelConfig) -> dict[str, Tensor]:
    """Inverse of `to_megatron`: HF name templates (`{layer}` left in) -> tensors. Expert rules take the list over
    all experts."""
    if rule.is_expert:
        assert isinstance(full, list), f"{rule.megatron}: expert rules take one tensor per global expert"
        if rule.per_expert:
            plain = TensorRule(rule.megatron, rule.hf, rule.fuse, rule.split)
            return {name.replace("{expert}", str(e)): tensor for e, one in enumerate(full)
                    for name, tensor in to_hf(plain, one, model_cfg).items()}
        return {rule.hf[0]: torch.stack([t.t() for t in full]).contiguous()}
    assert isinstance(full, Tensor)
    if rule.fuse == "copy":
        return {rule.hf[0]: full}
    if rule.fuse == "vocab":
        return {rule.hf[0]: full[: model_cfg.vocab_size]}
    if rule.fuse == "qkv":
        return dict(zip(rule.hf, split_qkv(full, model_cfg), strict=True))
    gate, up = full.chunk(2, dim=0)
    return {rule.hf[0]: gate.contiguous(), rule.hf[1]: up.contiguous()}


# ---- tensor-parallel sharding -------------------------------------------------------------------------------------


def shard_pieces(split: Split, full: Tensor, size: int) -> list[list[Tensor]] | None:
    """Per TP rank, the contiguous views of the unsharded `full` that make its shard, back to back (dim0: one
    chunk; glu: its gate rows, its up rows), so shards can be cut out of or received straight into `full`.
    None for a dim1 split (strided columns, not contiguous) and for replicated tensors."""
    if split == "dim0":
        return [[chunk] for chunk in full.chunk(size, dim=0)]
    if split == "glu":
        gate, up = full.chunk(2, dim=0)
        return [list(pair) for pair in zip(gate.chunk(size, dim=0), up.chunk(size, dim=0), strict=True)]
    return None


def split_shard(split: Split, shard_: Tensor) -> list[Tensor]:
    """A dim0 or glu shard cut into the pieces `shard_pieces` gives its rank, in the same order."""
    return list(shard_.chunk(2, dim=0)) if split == "glu" else [shard_]


def shard(rule: TensorRule, full: Tensor, rank: int, size: int) -> Tensor:
    """This TP rank's slice of the unsharded Megatron tensor."""
    if rule.split == "none" or size == 1:
        return full
    if rule.split == "dim1":
        return full.chunk(size, dim=1)[rank].contiguous()
    pieces = shard_pieces(rule.split, full, size)[rank]
    return torch.cat(pieces, dim=0) if len(pieces) > 1 else pieces[0].contiguous()


def unshard(rule: TensorRule, shards: list[Tensor]) -> Tensor:
    """Inverse of `shard`: the unsharded tensor from every TP rank's slice (in rank order)."""
    if rule.split == "none" or len(shards) == 1:
        return shards[0]
    if rule.split == "dim0":
        return torch.cat(shards, dim=0)
    if rule.split == "dim1":
        return torch.cat(shards, dim=1)
    halves = [s.chunk(2, dim=0) for s in shards]
    return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)


def hf_names(rule: TensorRule, layer: int | None, expert: int | None = None) -> tuple[str, ...]:
    """The HF names of `rule` at global `layer` (and global `expert`, for experts HF keeps one tensor each)."""
    return tuple(name.format(layer=layer, expert=expert) for name in rule.hf)


def every_hf_name(rule: TensorRule, layer: int | None, model_cfg: ModelConfig) -> tuple[str, ...]:
    """All HF names of `rule` at global `layer`: one set per expert for experts HF keeps one tensor each."""
    if rule.per_expert:
        return tuple(name for e in range(model_cfg.num_experts) for name in hf_names(rule, layer, e))
    return hf_names(rule, layer)


def megatron_name(rule: TensorRule, local_layer: int | None, local_expert: int | None = None) -> str:
    return rule.megatron.format(layer=local_layer, expert=local_expert)


def hf_parameter_names(model_cfg: ModelConfig) -> list[str]:
    """Every HF tensor name the whole model has (all layers, all stages)."""
    names: list[str] = []
    for rule in model_rules(model_cfg, first_stage=True, last_stage=True):  # one stage: no tied copy
        names.extend(hf_names(rule, None))
    for layer in range(model_cfg.num_layers):
        for rule in layer_rules(model_cfg, layer):
            names.extend(every_hf_name(rule, layer, model_cfg))
    return names


# ---- one rank's shard -> slices of HF tensors (weight sync without gathers) --------------------------------------


@dataclass(frozen=True)
class HFSlice:
    """A box of one HF tensor held by one rank: `tensor` is HF tensor `name`[start[0]:start[0]+tensor.shape[0], ...]
    of the full HF shape `full_shape` (a view of the rank's shard; `name` keeps its `{layer}` template)."""

    name: str
    tensor: Tensor
    full_shape: tuple[int, ...]
    start: tuple[int, ...]


def _rows(name: str, piece: Tensor, rank: int, size: int) -> HFSlice:
    """Slice `rank` of `size` equal row blocks of HF tensor `name`."""
    rows = piece.shape[0]
    return HFSlice(name, piece, (rows * size, *piece.shape[1:]), (rows * rank, *[0] * (piece.dim() - 1)))


def _split_qkv_groups(fused: Tensor, groups: int, per_group: int, d: int) -> tuple[Tensor, Tensor, Tensor]:
    """`split_qkv` of `groups` query groups (a TP shard holds num_query_groups / tp of them, whole)."""
    hidden = fused.shape[-1]
    q, k, v = fused.reshape(groups, (per_group + 2) * d, hidden).split([per_group * d, d, d], dim=1)
    return q.reshape(-1, hidden), k.reshape(-1, hidden), v.reshape(-1, hidden)


def _dense_slices(rule: TensorRule, local: Tensor, model_cfg: ModelConfig, rank: int, size: int) -> list[HFSlice]:
    """HF slices of a non-expert rule from TP rank `rank`'s shard `local` (of `size` ranks)."""
    if rule.split == "none":
        return [HFSlice(rule.hf[0], local, tuple(local.shape), (0,) * local.dim())] if rank == 0 else []
    if rule.fuse == "copy" and rule.split == "dim1":
        cols = local.shape[1]
        return [HFSlice(rule.hf[0], local, (local.shape[0], cols * size), (0, cols * rank))]
    if rule.fuse == "copy":
        return [_rows(rule.hf[0], local, rank, size)]
    if rule.fuse == "vocab":
        rows = local.shape[0]
        real = real_vocab_rows(model_cfg.vocab_size, rank * rows, rows)
        full = (model_cfg.vocab_size, *local.shape[1:])
        return [HFSlice(rule.hf[0], local[:real], full, (rank * rows, 0))] if real else []
    if rule.fuse == "qkv":
        groups, d = model_cfg.num_query_groups, model_cfg.head_dim
        parts = _split_qkv_groups(local, groups // size, model_cfg.num_attention_heads // groups, d)
        return [_rows(name, part, rank, size) for name, part in zip(rule.hf, parts, strict=True)]
    gate, up = local.chunk(2, dim=0)  # a glu shard is [its gate rows; its up rows]
    return [_rows(rule.hf[0], gate, rank, size), _rows(rule.hf[1], up, rank, size)]


def hf_slices(rule: TensorRule, local: Tensor, model_cfg: ModelConfig, *, rank: int, size: int,
              expert: int | None = None) -> list[HFSlice]:
    """The slices of HF tensors that this rank's shard `local` of `rule` holds (TP or expert-TP rank `rank` of
    `size`; `expert`: the global index of a routed expert's tensor): together, over all ranks, they tile every HF
    tensor of the rule exactly once (replicated tensors come from rank 0 alone; vocabulary padding rows from none).
    Names keep `{layer}`; an expert's are formatted with `expert`. Views of `local`, no copy (`to_hf` without the
    gather)."""
    if not rule.is_expert:
        return _dense_slices(rule, local, model_cfg, rank, size)
    assert expert is not None, f"{rule.megatron}: expert rules need the global expert index"
    if rule.per_expert:
        plain = TensorRule(rule.megatron, tuple(n.replace("{expert}", str(expert)) for n in rule.hf), rule.fuse,
                           rule.split)
        return _dense_slices(plain, local, model_cfg, rank, size)
    experts = model_cfg.num_experts
    if rule.fuse == "expert_down":  # linear_fc2 [h, f/size] -> down_proj[e] [f, h] rows rank*f/size..
        cols = local.shape[1]
        return [HFSlice(rule.hf[0], local.t().unsqueeze(0), (experts, cols * size, local.shape[0]),
                        (expert, cols * rank, 0))]
    # expert_glu: linear_fc1 [gate_r; up_r] [2f/size, h] -> gate_up_proj[e] [h, 2f]: gate columns, then up columns
    gate, up = local.chunk(2, dim=0)
    f_local = gate.shape[0]
    full = (experts, local.shape[1], 2 * f_local * size)
    return [HFSlice(rule.hf[0], gate.t().unsqueeze(0), full, (expert, 0, f_local * rank)),
            HFSlice(rule.hf[0], up.t().unsqueeze(0), full, (expert, 0, f_local * (size + rank)))]
