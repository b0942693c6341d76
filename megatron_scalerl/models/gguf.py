"""A GGUF file (llama.cpp's format) as an ordinary HF checkpoint directory: transformers' GGUF loader dequantizes its
weights to fp32, and the directory gets them as safetensors beside config.json, generation_config.json and the
tokenizer (its chat template and end tokens included), so every path of ours (`hf:DIR`, `scalerl convert`, `scalerl
serve`, weight sync) reads it as any released checkpoint.

    hf_dir = gguf_to_hf(Path("SmolLM2-135M-Instruct.Q4_1.gguf"), Path("runs/smollm2_135m_model"))

Needs the `gguf` and `accelerate` packages (the `cpu` extra). A quantized file's weights keep their rounding: the
model is the one the file holds, in fp32.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from megatron_scalerl.errors import UserError
from megatron_scalerl.fileio import replace_durably
from megatron_scalerl.models.tokenizer import ensure_generation_config


def gguf_to_hf(gguf_file: Path, out_dir: Path) -> Path:
    """Write the HF checkpoint of `gguf_file` into `out_dir` (built beside it, then renamed into place: a partial
    build never looks finished); returns `out_dir`. UserError for a file transformers cannot read."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not gguf_file.is_file():
        raise UserError(f"{gguf_file}: no such GGUF file")
    tmp = out_dir.with_name(f".{out_dir.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        model = AutoModelForCausalLM.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name,
                                                     dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)
    except (ImportError, OSError, ValueError, KeyError) as exc:
        raise UserError(f"{gguf_file}: transformers cannot read it as a GGUF model ({type(exc).__name__}: {exc})"
                        ) from None
    # loaded from GGUF, the model counts as quantized and save_pretrained refuses it: its weights are plain fp32 now
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(str(tmp))
    tokenizer.save_pretrained(str(tmp))
    ensure_generation_config(tmp, json.loads((tmp / "config.json").read_text()))
    if out_dir.exists():
        shutil.rmtree(out_dir)
    replace_durably(tmp, out_dir)
    return out_dir
