"""A byte-level BPE tokenizer trained locally, for the tiny models (nothing can be downloaded from a hub).

    tokenizer = train_tokenizer(texts, vocab_size=1024, markers=("<think>", "</think>"))  # PreTrainedTokenizerFast
    tokenizer.save_pretrained(hf_dir)                         # beside config.json: vLLM and transformers load it

Byte-level: any text encodes (no unknown token), and decoding gives the text back. Special tokens: BOS (prepended
to every encoded text), EOS (the generators stop on it; config.json's eos_token_id) and the caller's `markers` (the
thinking markers) as single tokens, so the interruption policy and the grader find them by id and by text.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from megatron_scalerl.errors import UserError

# The files a Hugging Face tokenizer may consist of (copied beside a converted or served checkpoint), and those
# that alone make one loadable.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "tokenizer.model", "vocab.json", "merges.txt", "chat_template.jinja", "chat_template.json")
TOKENIZER_CORE_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")

BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
BYTE_ALPHABET = 256


def has_tokenizer(directory: str | Path) -> bool:
    """Whether `directory` holds a tokenizer transformers and vLLM can load."""
    return any((Path(directory) / name).is_file() for name in TOKENIZER_CORE_FILES)


def tokenizer_facts(directory: str | Path):
    """The tokenizer of `directory` for what a launch checks and records before any role starts (its length and
    special token ids): with a `tokenizer.json`, transformers' generic fast tokenizer, whose import leaves out the
    torch compiler stack that `AutoTokenizer`'s pulls in (about 5 s of a launch's start on 2 cores); else
    `AutoTokenizer`. The roles that encode text (the orchestrator, the evaluation) load the model's own class with
    `AutoTokenizer`, whose encodings may differ (a class of its own may add tokens)."""
    if (Path(directory) / "tokenizer.json").is_file():
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(str(directory))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(directory))


def special_token_ids(tokenizer) -> dict[str, int | None]:
    """The token ids an HF config.json records for `tokenizer` (the generators stop on `eos_token_id`)."""
    return {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id}


GENERATION_CONFIG = "generation_config.json"  # a checkpoint's end tokens (vLLM stops at its eos_token_id too)


def ensure_generation_config(directory: Path, config: dict[str, Any]) -> None:
    """Give the checkpoint in `directory` a generation_config.json if it has none: its config.json's (`config`)
    special token ids, so that every checkpoint we write carries its end tokens."""
    path = directory / GENERATION_CONFIG
    if not path.is_file():
        ids = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if config.get(k) is not None}
        path.write_text(json.dumps(ids, indent=2) + "\n")


def end_token_ids(tokenizer, directory: str | Path | None = None) -> frozenset[int]:
    """Every token a generator stops at, as vLLM reads them: the tokenizer's EOS and the `eos_token_id` (one id or
    a list) of the generation_config.json in `directory` (default: the tokenizer's own directory). SmolLM2 and
    Llama-3-Instruct end a turn with a token that is not their tokenizer's EOS. A tokenizer built in memory (no
    `name_or_path`) has only its EOS."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    source = directory if directory is not None else getattr(tokenizer, "name_or_path", "")
    path = Path(source) / GENERATION_CONFIG
    if source and path.is_file():
        try:
            eos = json.loads(path.read_text()).get("eos_token_id")
        except (json.JSONDecodeError, AttributeError) as exc:
            raise UserError(f"{path}: not a generation config ({exc})") from None
        ids.update(eos if isinstance(eos, list) else [eos] if isinstance(eos, int) else [])
    return frozenset(ids)


def train_tokenizer(texts: Iterable[str], *, vocab_size: int, markers: Sequence[str] = (),
                    digit_groups: bool = False):
    """A tokenizer of at most `vocab_size` ids (the model's embedding rows), trained on `texts`; each of `markers`
    is one special token. `digit_groups`: numbers split from what is around them into groups of up to three digits
    (as Llama 3's tokenizer does), so a number is the same tokens wherever it is written (a byte-level BPE alone
    merges " 9" in one place and "952" in another)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    special = [BOS, EOS, *markers]
    if vocab_size < BYTE_ALPHABET + len(special):
        raise UserError(f"vocab_size {vocab_size}: a byte-level tokenizer needs at least "
                        f"{BYTE_ALPHABET + len(special)} ids")
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    if digit_groups:
        core.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(r"\d{1,3}"), "isolated"),
                                                      core.pre_tokenizer])
    core.decoder = decoders.ByteLevel()
    core.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=special, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    core.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A $B",
                                                        special_tokens=[(BOS, core.token_to_id(BOS))])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, bos_token=BOS, eos_token=EOS, pad_token=EOS,
                                        additional_special_tokens=list(markers))
    if len(tokenizer) > vocab_size:
        raise AssertionError(f"trained {len(tokenizer)} ids for a vocabulary of {vocab_size}")
    return tokenizer
