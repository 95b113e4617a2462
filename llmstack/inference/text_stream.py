"""Incremental detokenization for streaming: the text of a growing completion, released in pieces
that are never taken back.

Two things are held back until the next tokens settle them: the bytes of an unfinished UTF-8
character (decoded as U+FFFD) and a tail that could be the beginning of a stop string. A stop
string ends the text before it, so what was streamed equals `generate_text`'s final, cut text.
"""

from collections.abc import Callable, Iterable, Sequence
from typing import cast

import torch
from transformers import PreTrainedTokenizerBase

REPLACEMENT = "\ufffd"


class IncrementalText:
    """Feed token ids with `push`; each call returns the new text that is safe to show.

    Each push decodes a short window, not the whole completion (as vLLM's incremental
    detokenizer does): the tokens already turned into text before the previous push give the
    context (a tokenizer may render a token differently at the start of a text), and the new
    text is what the window decodes to beyond that context. Tokens whose text ends in an
    unfinished character stay in the window until it completes."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, stop_strings: Iterable[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop_strings = tuple(s for s in stop_strings if s)
        self.tokens: list[int] = []
        self.context_start = 0  # tokens[context_start:text_end] are the window's settled context
        self.text_end = 0  # tokens before this index have settled into text
        self.held = ""  # settled text not yet returned: a tail that could begin a stop string
        self.stopped = False  # a stop string has appeared; nothing more is returned

    def push(self, token_ids: Sequence[int]) -> str:
        if self.stopped:
            return ""
        self.tokens.extend(token_ids)
        self._settle(whole=False)
        # Returned text holds no beginning of a stop string, so only the held text is searched.
        cut = first_stop(self.held, self.stop_strings)
        if cut is not None:
            self.stopped = True
            return self._release(cut)
        return self._release(len(self.held) - self._partial_stop_length(self.held))

    def finish(self) -> str:
        """The text still held back once generation has ended."""
        if self.stopped:
            return ""
        self.stopped = True
        self._settle(whole=True)
        return self._release(len(self.held))

    def _settle(self, whole: bool) -> None:
        """Add the window's new text to `held`, unless it ends in an unfinished character and the
        completion is not `whole` yet."""
        context = self._decode(self.tokens[self.context_start : self.text_end])
        window = self._decode(self.tokens[self.context_start :])
        if whole or (len(window) > len(context) and not window.endswith(REPLACEMENT)):
            self.held += window[len(context) :]
            self.context_start, self.text_end = self.text_end, len(self.tokens)

    def _decode(self, token_ids: list[int]) -> str:
        return cast(str, self.tokenizer.decode(token_ids, skip_special_tokens=True))

    def _release(self, end: int) -> str:
        piece, self.held = self.held[:end], self.held[end:]
        return piece

    def _partial_stop_length(self, text: str) -> int:
        """Length of the longest tail of `text` that is a proper prefix of a stop string."""
        for n in range(min(len(text), max((len(s) - 1 for s in self.stop_strings), default=0)), 0, -1):
            if any(s.startswith(text[-n:]) for s in self.stop_strings):
                return n
        return 0


def first_stop(text: str, stop_strings: Iterable[str]) -> int | None:
    """Index where the earliest stop string in `text` begins, or None."""
    return min((i for i in (text.find(s) for s in stop_strings if s) if i >= 0), default=None)


class StopAwareStreamer:
    """A streamer for `generate` (transformers' put/end protocol) that writes one prompt's
    completion through `write` as it is generated, cut before the first stop string."""

    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, write: Callable[[str], object], stop_strings: Iterable[str] = ()
    ) -> None:
        self.text = IncrementalText(tokenizer, stop_strings)
        self.write = write
        self.prompt_seen = False

    def put(self, token_ids: torch.Tensor) -> None:
        if not self.prompt_seen:  # `generate` puts the prompt first
            self.prompt_seen = True
            return
        self.write(self.text.push(token_ids.reshape(-1).tolist()))

    def end(self) -> None:
        self.write(self.text.finish())
