"""Structured output: sampling constrained to a JSON schema, any JSON object, or a regular
expression, by masking at each step the tokens that cannot continue a matching text.

The grammar engine is llguidance (the [structured] extra): it installs as one wheel with no
dependencies (xgrammar pulls in triton and a TVM runtime here; outlines-core precompiles an index
per schema, slow for large vocabularies), wraps a transformers fast tokenizer directly, computes a
mask in tens of microseconds with no precomputation per schema, and is the engine vLLM, SGLang and
llama.cpp offer for the same job. A rejected schema is reported when the request arrives.
"""

import json
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from llmstack.errors import require

# JSON with no whitespace between its tokens: a model free to add whitespace may never stop adding it.
COMPACT = {"whitespace_flexible": False}


class GrammarError(ValueError):
    """The requested format cannot be compiled into a grammar."""


@dataclass(frozen=True)
class Grammar:
    """A compiled llguidance grammar (its serialized form); `describe` names it in errors."""

    text: str
    describe: str


def json_schema_grammar(schema: dict[str, Any] | bool) -> Grammar:
    llguidance = require("llguidance", "structured")
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), overrides=COMPACT)
    except ValueError as e:
        raise GrammarError(f"the JSON schema is not valid: {e}") from None
    return Grammar(grammar, "the JSON schema")


def json_object_grammar() -> Grammar:
    return json_schema_grammar({"type": "object"})


def regex_grammar(pattern: str) -> Grammar:
    llguidance = require("llguidance", "structured")
    return Grammar(llguidance.LLMatcher.grammar_from_regex(pattern), "the regular expression")


class GrammarTokenizer:
    """The tokenizer as llguidance sees it (built once per engine: it reads every token's bytes),
    and a factory of per-request matchers."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int) -> None:
        self.llguidance = require("llguidance", "structured")
        hf = require("llguidance.hf", "structured")
        self.vocab_size = vocab_size
        self.tokenizer = hf.from_tokenizer(tokenizer, n_vocab=vocab_size)

    def check(self, grammar: Grammar) -> None:
        """Raise GrammarError if `grammar` does not compile for this tokenizer."""
        error = self.llguidance.LLMatcher.validate_grammar(grammar.text, self.tokenizer)
        if error and not error.startswith("WARNING"):
            raise GrammarError(f"{grammar.describe} cannot be used: {error}")

    def matcher(self, grammar: Grammar) -> "Matcher":
        return Matcher(self, grammar)


class Matcher:
    """One request's position in its grammar: `mask` restricts the next token's logits; `consume`
    advances by the token sampled; `done` once the grammar allows nothing more."""

    def __init__(self, owner: GrammarTokenizer, grammar: Grammar) -> None:
        self.torch_ops = require("llguidance.torch", "structured")
        self.matcher = owner.llguidance.LLMatcher(owner.tokenizer, grammar.text)
        self.bitmask = self.torch_ops.allocate_token_bitmask(1, owner.vocab_size)

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """(1, vocab) logits with the tokens the grammar forbids at -inf (a new tensor)."""
        self.torch_ops.fill_next_token_bitmask(self.matcher, self.bitmask)
        masked = logits.float().cpu().clone()
        self.torch_ops.apply_token_bitmask_inplace(masked, self.bitmask)
        return masked.to(logits.device)

    def consume(self, token: int) -> None:
        if not self.matcher.consume_token(token):
            raise RuntimeError(f"the grammar refused token {token}: {self.matcher.get_error()}")

    @property
    def done(self) -> bool:
        return bool(self.matcher.is_stopped())
