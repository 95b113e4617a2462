"""Generation with an encoder-decoder (span corruption's T5): the encoder reads each prompt, the
decoder writes from the start token. llmstack's encoder-decoder generates as its stock
`T5ForConditionalGeneration` conversion (the same logits), through transformers' generate."""

from collections.abc import Sequence

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from llmstack.models import LLMStackForSpanCorruption
from llmstack.models.t5_interop import to_t5

from .sampling import SamplingParams
from .text_stream import first_stop


def generate_seq2seq(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[str],
    *,
    max_new_tokens: int,
    sampling: SamplingParams,
    seed: int | None = None,
    stop_strings: Sequence[str] = (),
) -> list[str]:
    """Each prompt's output text, cut before its first stop string. Prompts end in EOS, as the
    encoder's training inputs do; sentinels (`<extra_id_k>`) in a prompt ask for the spans they
    stand for, and stay in the output, which names each span by its sentinel."""
    hf = to_t5(model) if isinstance(model, LLMStackForSpanCorruption) else model
    eos = tokenizer.eos_token_id
    rows = [tokenizer(p, add_special_tokens=False)["input_ids"] + [eos] for p in prompts]
    width = max(len(r) for r in rows)
    pad = tokenizer.pad_token_id
    input_ids = torch.tensor([r + [pad] * (width - len(r)) for r in rows], device=hf.device)
    attention_mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows], device=hf.device)
    if seed is not None:
        torch.manual_seed(seed)
    config = hf.config
    sample = sampling.temperature > 0
    output = hf.generate(  # type: ignore[operator]  # transformers types generate loosely
        input_ids=input_ids,
        attention_mask=attention_mask,
        max_new_tokens=max_new_tokens,
        do_sample=sample,
        **(dict(temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p) if sample else {}),
        repetition_penalty=sampling.repetition_penalty,
        eos_token_id=eos,
        pad_token_id=pad,
        # transformers sizes the decoder's cache by the encoder's depth: stacks of unequal depth decode without one
        use_cache=config.num_decoder_layers == config.num_layers,
    )
    texts = []
    for row in output[:, 1:]:  # after the start token
        ids = [int(t) for t in row if int(t) not in (pad, eos)]
        text = str(tokenizer.decode(ids))
        stop = first_stop(text, stop_strings)
        texts.append(text if stop is None else text[:stop])
    return texts
