"""Byte-level BPE tokenizers trained with `tokenizers`, saved as Hugging Face tokenizer directories."""

import os
from collections.abc import Iterable, Sequence
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from llmstack.errors import UserError

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
MASK_TOKEN = "<|mask|>"  # the masked-LM objective's stand-in for a hidden token (EuroBERT's spelling)
SENTINEL_TOKEN = "<extra_id_{}>"  # span corruption's k-th sentinel (T5's spelling; llmstack.data.span_corruption)


def train_tokenizer(
    texts: Iterable[str],
    vocab_size: int,
    out_dir: str | Path,
    min_frequency: int = 2,
    extra_special_tokens: Sequence[str] = (),
    encoder_tokens: bool = False,
    sentinels: int = 0,
) -> PreTrainedTokenizerFast:
    """Train byte-level BPE on an iterable of strings and save it to `out_dir`.

    The EOS token gets id 0 and the pad token id 1; `AutoTokenizer.from_pretrained(out_dir)`
    loads the result. `encoder_tokens` adds what a masked-LM encoder needs: the mask token (id 2),
    and the EOS token, which packing puts between documents, declared as the separator and
    classification token ([SEP], [CLS]). `sentinels` adds that many span-corruption sentinels,
    `<extra_id_0>`, `<extra_id_1>`, ... (T5's), as special tokens after those.
    """
    encoder = {"mask_token": MASK_TOKEN, "sep_token": EOS_TOKEN, "cls_token": EOS_TOKEN} if encoder_tokens else {}
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[
            EOS_TOKEN,
            PAD_TOKEN,
            *([MASK_TOKEN] if encoder_tokens else []),
            *(SENTINEL_TOKEN.format(k) for k in range(sentinels)),
            *extra_special_tokens,
        ],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token=EOS_TOKEN, bos_token=EOS_TOKEN, pad_token=PAD_TOKEN, **encoder
    )
    os.makedirs(out_dir, exist_ok=True)
    fast.save_pretrained(out_dir)
    return fast


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    if not os.path.isdir(path):
        raise UserError(f"tokenizer directory {path} not found; train one with `llmstack data train-tokenizer`")
    return AutoTokenizer.from_pretrained(path)
