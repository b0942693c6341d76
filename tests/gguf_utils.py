"""A tiny GGUF file written with the `gguf` package's writer, as llama.cpp's convert_hf_to_gguf.py writes a Llama:
its config as `llama.*` keys, a GPT-2-style BPE tokenizer (tokens, merges, types, special ids, chat template), the
tensors under GGUF names with q/k rows permuted for llama.cpp's rotary layout. The tests convert it back with
`models.gguf.gguf_to_hf` and compare with the HF checkpoint it was written from."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np


def _permute(weights: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k permutation (convert_hf_to_gguf.py, LlamaModel.permute): HF's half-split rotary layout to
    GGML's interleaved one."""
    return (weights.reshape(heads, 2, weights.shape[0] // heads // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def write_llama_gguf(hf_dir: Path, out: Path) -> Path:
    """The GGUF of the fp32 Llama checkpoint in `hf_dir` (config.json, model.safetensors, a byte-level BPE
    tokenizer.json with a chat template) at `out`."""
    import gguf
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    config = json.loads((hf_dir / "config.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    layers, heads, kv_heads = config["num_hidden_layers"], config["num_attention_heads"], config["num_key_value_heads"]
    writer = gguf.GGUFWriter(str(out), "llama")
    writer.add_name("tiny llama")
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(layers)
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(config["head_dim"])
    writer.add_rope_freq_base(config["rope_parameters"]["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    model = json.loads((hf_dir / "tokenizer.json").read_text())["model"]
    tokens = [token for token, _ in sorted(model["vocab"].items(), key=lambda item: item[1])]
    special = set(tokenizer.all_special_ids)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in model["merges"]])
    writer.add_token_types([gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL
                            for i in range(len(tokens))])
    writer.add_bos_token_id(tokenizer.bos_token_id)
    writer.add_eos_token_id(tokenizer.eos_token_id)
    writer.add_pad_token_id(tokenizer.pad_token_id)
    writer.add_chat_template(tokenizer.chat_template)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, layers)
    for name, tensor in load_file(hf_dir / "model.safetensors").items():
        weights = tensor.float().numpy()
        if name.endswith("q_proj.weight"):
            weights = _permute(weights, heads)
        elif name.endswith("k_proj.weight"):
            weights = _permute(weights, kv_heads)
        writer.add_tensor(names.get_name(name, try_suffixes=(".weight", ".bias")), np.ascontiguousarray(weights))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
