"""Will it fit: per-GPU memory of the trainer's layout and of a generator's, from the recipe alone (pure arithmetic).
What differs between model families comes per layer from the family's `LayerPlan` (`families.layer_plan`): a MoE
or a dense MLP (shared experts; where the router's weight applies; a score-correction bias), GQA or multi-latent
attention (MLA), QK norm, RoPE, and the attention chunk that bounds the scores unfused attention keeps.

Trainer, per GPU of the most loaded pipeline stage (bytes):
- weights: the stage's share of parameters (dense ones / tp, but norms, routers and MLA's down-projections whole on
  every TP rank; routed experts / (ep x expert_tp), embedding and output layer / tp on their stages) x 2 in bf16 or
  4 in fp32 (the FP32 head always 4; a tied embedding is the head, and a pipeline's last stage holds a copy of it);
  a router's score-correction bias is an FP32 buffer beside an FP32 token count per expert (no gradient);
- gradients: 4 bytes per parameter (Megatron's main grads are FP32: grad_reduce_in_fp32);
- optimizer: Adam's two moments (+ the FP32 master copy in bf16) = 8 (12) bytes per parameter, sharded over the
  parameter's data-parallel group by the distributed optimizer (experts: the expert-data-parallel group);
- activations of the micro-batches in flight (1F1B keeps `pp` of them on the first stage: the stage's layers x pp =
  all layers' worth of one micro-batch) at micro_batch_size x (max_prompt_tokens + max_new_tokens) tokens: per layer
  the tensors autograd keeps (norm inputs, q/k/v and their norms, MLA's latents, RoPE's cos and sin, attention
  output, MLP inputs, SwiGLU halves, the router's scores and the top-k copies of each routed token, gathered over
  expert TP; DeepSeek-V3's FP32 routing keeps ~2 x experts bytes per token more: not counted, ~0.1%), split by
  tp (sequence parallelism splits the rest), or with full recomputation the layer inputs only plus one layer's
  working set; Transformer Engine kernels (GPU: flash attention, no scores kept) or torch
  ones (CPU: unfused attention keeps rows x heads x seq x window scores; tests/test_memory_plan.py measures these);
- the FP32 head's chunked log-probs: 1024-token chunks of FP32 logits (forward, softmax, gradient), and its
  backward's FP32 gradients of the head weight and of the micro-batch's hidden states (each cast to its tensor's
  dtype where that is not FP32);
- a fixed runtime reserve (CUDA context, NCCL buffers, allocator slack).

Generator (one vLLM server of generator_tp GPUs), per GPU: all weights / generator_tp but the norms, routers and
MLA's down-projections, whole on every GPU (the head FP32 with `fp32_lm_head`; a tied one an FP32 copy beside the
embedding; MLA's kv_b_proj twice: vLLM's absorbed copies beside it), the KV cache (GQA: k and v of the KV heads;
MLA: the kv_lora_rank + qk_rope_head_dim latent, on every GPU) of at least one sequence at full length
(max_prompt_tokens + max_new_tokens; the rest of the GPU up to vLLM's gpu_memory_utilization, 0.9, holds more:
`kv_sequences`), and the runtime reserve; and what weight sync makes after vLLM started: the FP32 head's copy, NCCL communicators, buckets in flight, a staging copy (`weight_sync_extras`),
which the launch keeps out of vLLM's share (`scalerl serve --reserve-gib`: gpu_memory_utilization lowered by them).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from megatron_scalerl.families import layer_plan
from megatron_scalerl.families.spec import LayerPlan
from megatron_scalerl.models.mapping import padded_vocab_size
from megatron_scalerl.platform.precision import resolve_precision, serving_dtype
from megatron_scalerl.recipe import ModelConfig, Recipe

GIB = 2**30
RUNTIME_RESERVE_GIB = 3.0  # CUDA context, NCCL communicators and buffers, allocator fragmentation
# A weight-sync NCCL communicator's buffers on one generator GPU: a broadcast ring between nodes, up to 16 channels x
# 2 ring neighbours x ~8 MiB (NCCL_BUFFSIZE's 4 MiB and LL128's) = ~0.25 GiB. An estimate until `make gpu-check`
# measures one.
NCCL_COMMUNICATOR_GIB = 0.25
STAGING_PART = "staging copy (weight sync)"
NCCL_PART = "nccl communicators (weight sync)"
WEIGHT_SYNC_QUEUED_BUCKETS = 2  # weight_sync/transport.py's QUEUED_BUCKETS (models/ may not import it)
LOGPROB_CHUNK_TOKENS = 1024  # trainer/logprobs.py's DEFAULT_CHUNK_TOKENS
VLLM_MAX_NUM_SEQS = 256
VLLM_GPU_MEMORY_UTILIZATION = 0.9
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass
class MemoryPlan:
    """Per-GPU bytes by part (insertion order is print order). A generator's `beside` parts are what weight sync
    makes after vLLM started (`weight_sync_extras`): the launch lowers vLLM's gpu_memory_utilization by them
    (`scalerl serve --reserve-gib`), so they count in the total as the `parts` do."""

    what: str
    parts: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    beside: dict[str, float] = field(default_factory=dict)

    @property
    def total_gib(self) -> float:
        return (sum(self.parts.values()) + sum(self.beside.values())) / GIB

    def fits(self, gpu_gib: float, usable_fraction: float = 1.0) -> bool:
        return self.total_gib <= gpu_gib * usable_fraction

    def as_dict(self) -> dict:
        return {"what": self.what, "gib": {k: v / GIB for k, v in {**self.parts, **self.beside}.items()},
                "beside_vllm_gib": {k: v / GIB for k, v in self.beside.items()}, "total_gib": self.total_gib,
                "notes": self.notes}


@dataclass(frozen=True)
class ParamCounts:
    """Parameters of one kind each, whole model (not split)."""

    # split over TP (by heads, by FFN columns): q/k/v/o (multi-latent attention: its up-projections and o), the dense
    # MLP or the shared experts, per layer
    dense_per_layer: list[int]
    # whole on every TP rank: the layer's norms (q/k norms; MLA's latent norms), the router, MLA's down-projections
    replicated_per_layer: list[int]
    experts_per_layer: list[int]  # routed experts, per layer (0 on dense layers)
    router_bias_per_layer: list[int]  # the routers' FP32 score-correction bias (`LayerPlan.router_expert_bias`)
    embedding: int
    output: int  # the output layer (0 when tied to the embedding)
    final_norm: int

    @property
    def total(self) -> int:
        return (sum(self.dense_per_layer) + sum(self.replicated_per_layer) + sum(self.experts_per_layer)
                + sum(self.router_bias_per_layer) + self.embedding + self.output + self.final_norm)


def _attention_params(m: ModelConfig, plan: LayerPlan) -> tuple[int, int]:
    """A layer's attention parameters: (split over TP by heads, whole on every TP rank). Multi-latent attention:
    q_a_proj [q_lora_rank, h] + q_a_layernorm + q_b_proj [heads x (nope + rope), q_lora_rank] (without q LoRA:
    q_proj [heads x (nope + rope), h]), kv_a_proj_with_mqa [kv_lora_rank + rope, h] + kv_a_layernorm, kv_b_proj
    [heads x (nope + v), kv_lora_rank], o_proj [h, heads x v]; the down-projections and latent norms whole on every
    rank (`platform.layer_backend`)."""
    h, heads = m.hidden_size, m.num_attention_heads
    if not plan.latent_attention:
        qk_norms = 2 * m.head_dim if plan.qk_norm == "rms" else 0
        return h * m.head_dim * (2 * heads + 2 * m.num_query_groups), qk_norms
    qk = m.qk_nope_head_dim + m.qk_rope_head_dim
    q_down, q_up = (h * m.q_lora_rank + m.q_lora_rank, m.q_lora_rank * heads * qk) if m.q_lora_rank else (0, h * heads * qk)
    kv_down = h * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank
    kv_up = m.kv_lora_rank * heads * (m.qk_nope_head_dim + m.v_head_dim)
    return q_up + kv_up + heads * m.v_head_dim * h, q_down + kv_down


def param_counts(recipe: Recipe, tp: int = 1) -> ParamCounts:
    m = recipe.model
    h = m.hidden_size
    dense, replicated, experts, router_bias = [], [], [], []
    for layer in range(m.num_layers):
        plan = layer_plan(m, layer)
        split, whole = _attention_params(m, plan)
        whole += 2 * h  # input and pre-MLP norms
        if plan.moe:
            dense.append(split + 3 * h * m.moe_ffn_hidden_size * plan.shared_experts)
            replicated.append(whole + h * m.num_experts)  # the router
            experts.append(m.num_experts * 3 * h * m.moe_ffn_hidden_size)
            router_bias.append(m.num_experts if plan.router_expert_bias else 0)
        else:
            dense.append(split + 3 * h * m.ffn_hidden_size)
            replicated.append(whole)
            experts.append(0)
            router_bias.append(0)
    vocab = padded_vocab_size(m.vocab_size, tp) * h
    return ParamCounts(dense, replicated, experts, router_bias, vocab, 0 if m.tie_word_embeddings else vocab, h)


def _norm_bytes(recipe: Recipe, kernels: str, width: int | None = None) -> float:
    """Bytes an RMSNorm over `width` values (default: hidden_size) keeps per normalised vector: its input and 1/rms
    (Transformer Engine), or, computed in FP32 by torch ops, the FP32 input and normalised copy and 1/rms."""
    h, b = width or recipe.model.hidden_size, _body_bytes(recipe, kernels)
    return 8 * h + 4 if kernels == "torch" else b * h + 4


def _body_bytes(recipe: Recipe, kernels: str = "transformer_engine") -> int:
    """Bytes of a body weight or activation: 2 in bf16, 4 in fp32; `auto` as it resolves on GPUs (Transformer Engine
    kernels) or, for the torch kernels' profile, on this CPU."""
    cuda = kernels == "transformer_engine"
    return 2 if resolve_precision(recipe.trainer.precision, cuda=cuda).value == "bf16" else 4


def _layer_activation_bytes(recipe: Recipe, rows: int, seq: int, layer: int, kernels: str, recompute: bool) -> float:
    """Bytes autograd keeps for layer `layer` of one micro-batch of rows x seq tokens, per TP rank.

    kernels "transformer_engine" (GPUs): fused norms, flash attention (no scores kept), SwiGLU keeping its input and
    output. "torch" (CPUs, megatron's local layers): norms in FP32, unfused attention (FP32 scores and the
    probabilities kept: rows x heads x seq x window; multi-latent attention's FP32 sdpa keeps the FP32 probabilities
    only), eager SwiGLU (its input, both halves and its output). Attention: `_attention_bytes`. Both kernels: the
    unfused RoPE keeps its cos and sin cast to the body dtype, for q and for k (seq x RoPE features each, whatever
    the rows). With full recomputation: the layer's input only."""
    m, par = recipe.model, recipe.parallelism
    b, tp, h = _body_bytes(recipe, kernels), par.tp, m.hidden_size
    sequence_split = tp if par.sequence_parallel and tp > 1 else 1
    tokens = rows * seq
    if recompute:
        return tokens * h * b / sequence_split
    torch_kernels = kernels == "torch"
    plan = layer_plan(m, layer)
    replicated = 2 * _norm_bytes(recipe, kernels) + 2 * b * h  # two norms and their outputs (QKV and FC1 inputs)
    latents, attention = _attention_bytes(recipe, plan, kernels)
    swiglu = 5 if torch_kernels else 3  # x f: FC1's output (2f) and FC2's input (f), eager: gate and up copies
    if plan.moe:
        shared = swiglu * b * m.moe_ffn_hidden_size * plan.shared_experts / tp
        mlp = shared + _routed_bytes(recipe, layer, kernels) / sequence_split
    else:
        mlp = swiglu * b * m.ffn_hidden_size / tp
    total = tokens * ((replicated + latents) / sequence_split + attention / tp + mlp)
    if plan.rope:
        total += 4 * seq * (m.qk_rope_head_dim if plan.latent_attention else m.head_dim) * b
    if torch_kernels:  # the unfused attention's FP32 scores and probabilities
        window = min(seq, plan.attention_chunk) if plan.attention_chunk else seq
        total += rows * m.num_attention_heads / tp * seq * window * (4 if plan.latent_attention else 4 + b)
    return total


def _attention_bytes(recipe: Recipe, plan: LayerPlan, kernels: str) -> tuple[float, float]:
    """Bytes a layer's attention keeps per token: (on the rank's sequence slice, of all heads: split over TP).

    GQA: q, k, v and the output in the body dtype, k and v at their query groups (Transformer Engine, which keeps
    the softmax's FP32 log-sum-exp per head too) or expanded to every head (torch); the q/k norms `plan.qk_norm`
    says. Multi-latent attention: per token the latents' norms (q's only with q LoRA) and their outputs, the
    up-projections' inputs, whole on every TP rank; per head q and k of qk_nope + qk_rope features, v and the output
    of v_head_dim: in the body dtype with the log-sum-exp (Transformer Engine), or FP32 copies of q, k and v and the
    output in the body dtype (torch: `families/deepseek_v3/model/attention.py` runs sdpa in FP32)."""
    m = recipe.model
    b, heads, torch_kernels = _body_bytes(recipe, kernels), m.num_attention_heads, kernels == "torch"
    lse = 0 if torch_kernels else 4 * heads
    if plan.latent_attention:
        latents = sum(_norm_bytes(recipe, kernels, w) + b * w for w in (m.q_lora_rank, m.kv_lora_rank) if w)
        qk, v = heads * (m.qk_nope_head_dim + m.qk_rope_head_dim), heads * m.v_head_dim
        return latents, 4 * (2 * qk + v) + b * v if torch_kernels else b * (2 * qk + 2 * v) + lse
    hd, groups = m.head_dim, m.num_query_groups
    kv_heads = heads if torch_kernels else groups
    attention = b * (2 * heads + 2 * kv_heads) * hd + lse  # q k v, output, (lse)
    if plan.qk_norm == "l2":  # megatron's L2Norm, in FP32 on both kernels: the FP32 copy and its norm, per head
        attention += 4 * (heads + groups) * (hd + 1)
    elif plan.qk_norm == "rms":  # an RMSNorm over each q and k head, kept as the hidden-state norms keep theirs
        attention += (heads + groups) * _norm_bytes(recipe, kernels, hd)
    return 0.0, attention


def _routed_bytes(recipe: Recipe, layer: int, kernels: str) -> float:
    """Bytes a MoE layer's router and routed experts keep per token of a rank's sequence slice, routing balanced.

    The router: FP32 scores of every expert (sigmoid, or a softmax before the top-k; a softmax after the top-k keeps
    only k of them: counted as every expert's, a bound) and the routing map (experts x body bytes). Each of the
    token's top-k copies: the expert's input (and, when the router's weight scales the input, `LayerPlan.
    expert_input_weighted`, the scaled copy), its weight, and the expert's SwiGLU at moe_ffn_hidden_size /
    expert_tp (eager, weighting the output: also the weighted product). Expert TP gathers the routed tokens of its
    expert_tp ranks, so each rank runs expert_tp slices' worth of copies."""
    m, par = recipe.model, recipe.parallelism
    b, f = _body_bytes(recipe, kernels), m.moe_ffn_hidden_size / par.expert_tp_size
    weighted_input = layer_plan(m, layer).expert_input_weighted
    swiglu = 3 if kernels == "transformer_engine" else 5 if weighted_input else 6
    per_copy = b * m.hidden_size * (2 if weighted_input else 1) + b + swiglu * b * f
    return (4 + b) * m.num_experts + m.moe_router_topk * par.expert_tp_size * per_copy


def trainer_plan(recipe: Recipe, *, recompute: bool | None = None,
                 kernels: Literal["transformer_engine", "torch"] = "transformer_engine") -> MemoryPlan:
    """The trainer's per-GPU memory on its most loaded pipeline stage. `recompute` defaults to the recipe's
    `parallelism.recompute`; `kernels`: the layers' implementation, Transformer Engine (GPUs) or torch (CPUs)."""
    stages = [(True, recipe.parallelism.pp == 1), (recipe.parallelism.pp == 1, True)]  # (first, last) stages
    plans = [_stage_plan(recipe, first, last, recompute, kernels) for first, last in stages]
    return max(plans, key=lambda plan: plan.total_gib)


def _stage_plan(recipe: Recipe, first: bool, last: bool, recompute: bool | None, kernels: str) -> MemoryPlan:
    par, m = recipe.parallelism, recipe.model
    recompute = par.recompute == "full" if recompute is None else recompute
    counts = param_counts(recipe, par.tp)
    layers = range(m.num_layers // par.pp) if first else range(m.num_layers - m.num_layers // par.pp, m.num_layers)
    embedding = counts.embedding / par.tp if first else 0.0
    head = counts.output / par.tp if last else 0.0
    if m.tie_word_embeddings:  # the embedding is the head; a pipeline's last stage holds a copy of it
        head, embedding = embedding + (counts.embedding / par.tp if last and not first else 0.0), 0.0
    dense = (sum(counts.dense_per_layer[i] for i in layers) / par.tp + sum(counts.replicated_per_layer[i] for i in layers)
             + embedding)
    experts = sum(counts.experts_per_layer[i] for i in layers) / (par.ep * par.expert_tp_size)
    final_norm = counts.final_norm if last else 0.0
    weight_bytes = _body_bytes(recipe, kernels)
    bf16 = weight_bytes == 2
    head_bytes = 4 if recipe.trainer.fp32_lm_head else weight_bytes
    dp = par.dp_size(recipe.cluster.trainer_gpus)
    expert_dp = max(1, recipe.cluster.trainer_gpus // (par.pp * par.ep * par.expert_tp_size))
    plan = MemoryPlan(f"trainer ({'first' if first else 'last'} pipeline stage)" if par.pp > 1 else "trainer")
    router_bias = sum(counts.router_bias_per_layer[i] for i in layers)  # FP32, beside megatron's FP32 token counts
    plan.parts["weights"] = (dense + experts + final_norm) * weight_bytes + head * head_bytes + router_bias * 8
    plan.parts["gradients (fp32)"] = (dense + experts + final_norm + head) * 4
    optimizer_bytes = 12 if bf16 else 8  # two FP32 moments, and an FP32 master copy of 16-bit weights
    plan.parts["optimizer (distributed)"] = (((dense + final_norm) / dp + experts / expert_dp) * optimizer_bytes
                                             + head / dp * (8 if head_bytes == 4 else optimizer_bytes))
    rows, seq = par.micro_batch_size, _sequence_tokens(recipe)
    tokens = rows * seq
    micro_batches = max(1, recipe.rollout.prompts_per_step * recipe.rollout.generations_per_prompt
                        // (dp * par.micro_batch_size))
    in_flight = min(par.pp, micro_batches) if first else 1  # 1F1B: the first stage holds pp micro-batches
    per_layer = [_layer_activation_bytes(recipe, rows, seq, i, kernels, recompute) for i in layers]
    activations = sum(per_layer) * in_flight
    # the FP32 RoPE table the checkpoints keep, once (multi-latent attention makes its own inside the layer)
    if recompute and any(layer_plan(m, i).rope and not layer_plan(m, i).latent_attention for i in layers):
        activations += seq * m.head_dim * 4
    if last:  # the final norm's
        activations += tokens * _norm_bytes(recipe, kernels) / (par.tp if par.sequence_parallel and par.tp > 1 else 1)
    plan.parts["layer inputs (full recompute)" if recompute else "activations"] = activations
    if recompute:  # one layer's whole working set while its backward recomputes it
        plan.parts["recomputed layer"] = max(_layer_activation_bytes(recipe, rows, seq, i, kernels, False)
                                             for i in layers)
    if last:
        vocab_per_rank = padded_vocab_size(m.vocab_size, par.tp) / par.tp
        plan.parts["fp32 log-prob chunks"] = 3 * min(LOGPROB_CHUNK_TOKENS, tokens) * vocab_per_rank * 4
        plan.parts["head backward (fp32 gradients)"] = head_backward_bytes(recipe, tokens, weight_bytes, head_bytes)
    plan.parts["runtime reserve"] = RUNTIME_RESERVE_GIB * GIB
    plan.notes.append(f"{counts.total / 1e9:.2f}B parameters, {len(layers)} layers on this stage; micro-batch of "
                      f"{tokens} tokens, {in_flight} in flight; dp {dp}, expert dp {expert_dp}; {kernels} kernels")
    return plan


def head_backward_bytes(recipe: Recipe, tokens: int, body_bytes: int, head_bytes: int) -> float:
    """What the LM head's backward (trainer/logprobs.py) allocates beside the chunks, for a micro-batch of `tokens`
    tokens on one TP rank: the weight's gradient [padded vocab / tp, hidden] and the hidden states' [tokens, hidden],
    both in FP32, each cast to its tensor's dtype on return where that is not FP32 (`body_bytes`, `head_bytes`: bytes
    per value of the body's and the head's weights)."""
    par, m = recipe.parallelism, recipe.model
    vocab_per_rank = padded_vocab_size(m.vocab_size, par.tp) / par.tp
    weight_grad = vocab_per_rank * m.hidden_size * (4 + (head_bytes if head_bytes != 4 else 0))
    hidden_grad = tokens * m.hidden_size * (4 + (body_bytes if body_bytes != 4 else 0))
    return weight_grad + hidden_grad


def generator_plan(recipe: Recipe, *, cuda: bool = True) -> MemoryPlan:
    """One vLLM server's per-GPU memory: the weights as vLLM loads them (the serving dtype), the
    KV cache of one sequence at full length (vLLM refuses to start without it; `kv_sequences` says how many fit on a
    given GPU) and the runtime reserve. Beside it (`beside`, made after vLLM sized its cache): the FP32 LM head that
    weight sync makes (`weight_sync/fp32_head.py`), the NCCL communicators of the senders' groups, the buckets in
    flight, and with `weight_sync.staging: on` one whole copy of the weights (`weight_sync_extras`). The launch
    lowers vLLM's share by these (`reserve_gib`), so the whole must fit vLLM's gpu_memory_utilization of the GPU."""
    tp = recipe.parallelism.generator_tp
    counts = param_counts(recipe, 1)
    serve_bytes = _body_bytes(recipe)
    plan = MemoryPlan("generator")
    replicated, router_bias = sum(counts.replicated_per_layer), sum(counts.router_bias_per_layer)
    split = counts.total - replicated - router_bias + _absorbed_kv_up(recipe)
    plan.parts["weights"] = split * serve_bytes / tp + replicated * serve_bytes + router_bias * 4
    plan.parts["kv cache, one full-length sequence"] = kv_bytes_per_sequence(recipe)
    plan.parts["runtime reserve"] = RUNTIME_RESERVE_GIB * GIB
    plan.beside.update(weight_sync_extras(recipe, cuda=cuda))
    nodes = recipe.generator_server_nodes
    plan.notes.append(f"tp {tp}{f' (a server spanning {nodes} nodes)' if nodes > 1 else ''}; a sequence is up to "
                      f"{_sequence_tokens(recipe)} tokens; vLLM may use {VLLM_GPU_MEMORY_UTILIZATION:.0%} of a GPU "
                      "(gpu_memory_utilization), weight sync's parts kept out of vLLM's own")
    return plan


def weight_sync_senders(recipe: Recipe) -> int:
    """Trainer ranks that send weights (`models.weights.sends_weights`: data-parallel rank 0 for the dense weights,
    expert-data-parallel rank 0 for the experts), per pipeline stage the larger of the two sets: tp ranks,
    ep x expert_tp ranks on a MoE, never more than the stage's ranks."""
    par = recipe.parallelism
    per_stage = recipe.cluster.trainer_gpus // par.pp
    experts = par.ep * par.expert_tp_size if recipe.model.is_moe else 0
    return par.pp * min(per_stage, max(par.tp, experts))


def weight_sync_extras(recipe: Recipe, *, cuda: bool = True) -> dict[str, float]:
    """Per generator GPU, what weight sync adds after vLLM started (bytes, by part; what `scalerl serve
    --reserve-gib` keeps out of vLLM's share):
    - the FP32 LM head (`trainer.fp32_lm_head` under a 16-bit body): its FP32 copy of the head's slice, less the
      16-bit weight it replaces (a head tied to the embedding keeps the embedding: its copy is all extra);
    - on GPUs with NCCL, each sender's communicator (`NCCL_COMMUNICATOR_GIB`);
    - with NCCL, the buckets in flight on the GPU: two waiting to be loaded (`weight_sync.transport.QUEUED_BUCKETS`)
      and one arriving (gloo and disk receive into host memory);
    - `weight_sync.staging: on`: one whole copy of the weights, every worker receiving all of them
      (`launch_checks.staging_bytes`). `auto` stages only when the worker's free memory holds it, measured then."""
    m, tp = recipe.model, recipe.parallelism.generator_tp
    counts = param_counts(recipe, 1)
    serve = DTYPE_BYTES[serving_dtype(recipe, cuda)]
    extras: dict[str, float] = {}
    if recipe.trainer.fp32_lm_head and serve != 4:
        head = counts.embedding if m.tie_word_embeddings else counts.output
        extras["fp32 lm head (weight sync)"] = head * (4 if m.tie_word_embeddings else 4 - serve) / tp
    senders = weight_sync_senders(recipe)
    nccl = cuda and recipe.weight_sync.transport.type in ("auto", "nccl")
    if nccl:
        extras[NCCL_PART] = senders * NCCL_COMMUNICATOR_GIB * GIB
        # NCCL receives on the GPU, one thread: the queued buckets and the one arriving (gloo and disk receive
        # into host memory)
        extras["buckets in flight (weight sync)"] = ((WEIGHT_SYNC_QUEUED_BUCKETS + 1)
                                                     * recipe.weight_sync.bucket_mib * 2**20)
    if recipe.weight_sync.staging == "on":
        extras[STAGING_PART] = staging_bytes(recipe, cuda=cuda)
    return extras


def reserve_gib(recipe: Recipe) -> float:
    """GiB of each generator GPU kept out of vLLM's own share for weight sync (`weight_sync_extras` on GPUs):
    `scalerl serve --reserve-gib`."""
    return sum(weight_sync_extras(recipe, cuda=True).values()) / GIB


def vllm_share(reserve: float, gpu_gib: float) -> float:
    """vLLM's gpu_memory_utilization on GPUs of `gpu_gib` GiB with `reserve` GiB of each kept out of it for weight
    sync (`reserve_gib`): VLLM_GPU_MEMORY_UTILIZATION less the reserve's share. ValueError when that leaves vLLM
    less than half the GPU (the plan does not fit: `scalerl recipe show --plan`)."""
    share = VLLM_GPU_MEMORY_UTILIZATION - reserve / gpu_gib
    if share < 0.5:
        raise ValueError(f"weight sync needs {reserve:.2f} GiB of each {gpu_gib:.1f} GiB GPU beside vLLM, which would "
                         f"leave vLLM {share:.0%} of it (see scalerl recipe show --plan)")
    return share


def staging_bytes(recipe: Recipe, *, cuda: bool) -> int:
    """Bytes of one copy of the model's weights as a generator holds them: every parameter (`param_counts`, the
    vocabulary padded to 128) in the serving dtype (`platform.precision.serving_dtype`: the trainer's precision on
    GPUs, float32 on CPUs), an untied LM head in FP32 with `trainer.fp32_lm_head`. What staging receives into while
    the generator goes on serving the weights it has."""
    counts = param_counts(recipe)
    serve = DTYPE_BYTES[serving_dtype(recipe, cuda)]
    head = 4 if recipe.trainer.fp32_lm_head else serve
    return (counts.total - counts.output) * serve + counts.output * head


def _absorbed_kv_up(recipe: Recipe) -> int:
    """Parameters vLLM's GPU multi-latent attention holds twice: kv_b_proj (prefill) and its absorbed copies W_UK_T,
    W_UV (decode), split by heads over generator_tp."""
    m = recipe.model
    per_layer = m.kv_lora_rank * m.num_attention_heads * (m.qk_nope_head_dim + m.v_head_dim) if m.kv_lora_rank else 0
    return sum(per_layer for i in range(m.num_layers) if layer_plan(m, i).latent_attention)


def _sequence_tokens(recipe: Recipe) -> int:
    return recipe.rollout.max_prompt_tokens + recipe.rollout.max_new_tokens


def kv_bytes_per_sequence(recipe: Recipe) -> float:
    """KV-cache bytes per GPU of one full-length sequence on a generator. Per token and layer: GQA's k and v of each
    KV head (heads split by generator_tp, replicated when it exceeds them); multi-latent attention's latent and RoPE
    key, kv_lora_rank + qk_rope_head_dim values whatever the heads, on every TP rank (vLLM's MLA cache)."""
    m, tp = recipe.model, recipe.parallelism.generator_tp
    kv_heads = max(1, m.num_query_groups // tp)
    per_token = sum(m.kv_lora_rank + m.qk_rope_head_dim if layer_plan(m, i).latent_attention
                    else 2 * kv_heads * m.head_dim for i in range(m.num_layers))
    return _sequence_tokens(recipe) * per_token * _body_bytes(recipe)


def kv_sequences(recipe: Recipe, gpu_gib: float) -> int:
    """Full-length sequences a generator can hold at once on GPUs of `gpu_gib` GiB (vLLM decodes at most
    max_num_seqs, 256, and preempts when the cache is full)."""
    plan = generator_plan(recipe)
    free = gpu_gib * GIB * VLLM_GPU_MEMORY_UTILIZATION - (plan.parts["weights"] + plan.parts["runtime reserve"]
                                                          + sum(plan.beside.values()))
    return max(0, min(VLLM_MAX_NUM_SEQS, int(free // kv_bytes_per_sequence(recipe))))
