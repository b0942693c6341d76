"""A byte-level BPE tokenizer trained locally, for the tiny models (nothing can be downloaded from a hub).

    tokenizer = train_tokenizer(texts, vocab_size=1024)      # a transformers PreTrainedTokenizerFast
    tokenizer.save_pretrained(hf_dir)                         # beside config.json: vLLM and transformers load it

Byte-level: any text encodes (no unknown token), and decoding gives the text back. Special tokens: BOS (prepended
to every encoded text), EOS (the generators stop on it; config.json's eos_token_id) and the thinking markers
`<think>` / `</think>` as single tokens, so the interruption policy and the grader find them by id and by text.
"""

from __future__ import annotations

from collections.abc import Iterable

from megatron_scalerl.errors import UserError
from megatron_scalerl.rollout.prompts import THINK_CLOSE, THINK_OPEN

BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
SPECIAL_TOKENS = [BOS, EOS, THINK_OPEN, THINK_CLOSE]
BYTE_ALPHABET = 256


def train_tokenizer(texts: Iterable[str], *, vocab_size: int):
    """A tokenizer of exactly `vocab_size` ids at most (the model's embedding rows), trained on `texts`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < BYTE_ALPHABET + len(SPECIAL_TOKENS):
        raise UserError(f"vocab_size {vocab_size}: a byte-level tokenizer needs at least "
                        f"{BYTE_ALPHABET + len(SPECIAL_TOKENS)} ids")
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    core.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    core.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A $B",
                                                        special_tokens=[(BOS, core.token_to_id(BOS))])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, bos_token=BOS, eos_token=EOS, pad_token=EOS,
                                        additional_special_tokens=[THINK_OPEN, THINK_CLOSE])
    if len(tokenizer) > vocab_size:
        raise AssertionError(f"trained {len(tokenizer)} ids for a vocabulary of {vocab_size}")
    return tokenizer
