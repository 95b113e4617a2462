"""Data augmentation (opt-in, the config's `augment` section): augmented copies of a capped
fraction of the kept documents.

- `synonyms`: replace about `rate` of the words that have synonyms (seeded per document). English
  synonyms come from a WordNet database directory (Debian: `apt-get install wordnet-base`, then
  `wordnet: /usr/share/wordnet`); any language from a user's table (`tables: {zh: path}`): a text
  file whose every line is a group of synonyms separated by spaces or tabs (`#` starts a comment).
  Chinese text is cut into jieba words, other text into runs of letters and digits.
- `back_translation`: translate to a pivot language and back with two Hugging Face seq2seq model
  directories the user gives per language (`models: {en: [en->de, de->en]}`), greedy decoding.

Which documents get copies is decided by a hash of their id and `seed` (at most `fraction` of
them, the same ones on every rerun). A copy has the id `ID#METHOD` and `meta.augmented_from: ID`
and `meta.augmentation: METHOD`; dedup leaves copies out of its keys (they are near-duplicates of
their sources by design) and drops a copy when it drops its source.
"""

import hashlib
import random
import re
from collections import Counter
from collections.abc import Iterable
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

from llmstack.errors import UserError

from .document import Document
from .languages import document_language, load_jieba, profile

if TYPE_CHECKING:
    from transformers import GenerationMixin, PreTrainedTokenizerBase

_WORD_RUN = re.compile(r"\w+|\W+")
_WORDNET_FILES = ("data.noun", "data.verb", "data.adj", "data.adv")


@lru_cache(maxsize=4)
def wordnet_synonyms(directory: str) -> dict:
    """{word: synonyms} over the single-word lemmas of every synset in a WordNet 3 database."""
    paths = [Path(directory, name) for name in _WORDNET_FILES]
    if not all(p.is_file() for p in paths):
        raise UserError(
            f"{directory} is not a WordNet database (no data.noun, ...): apt-get install wordnet-base "
            "and give /usr/share/wordnet"
        )
    groups = []
    for path in paths:
        with open(path, encoding="latin-1") as f:
            for line in f:
                if line.startswith("  "):  # the licence header
                    continue
                fields = line.split()
                count = int(fields[3], 16)
                lemmas = (re.sub(r"\(.*\)$", "", w).lower() for w in fields[4 : 4 + 2 * count : 2])
                groups.append([w for w in lemmas if "_" not in w])
    return _synonym_map(groups)


@lru_cache(maxsize=16)
def table_synonyms(path: str) -> dict:
    """{word: synonyms} from a file of synonym groups, one group a line."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise UserError(f"cannot read the synonym table {path}: {e}") from None
    return _synonym_map(line.split("#")[0].split() for line in lines)


def _synonym_map(groups: Iterable[list[str]]) -> dict[str, list[str]]:
    synonyms: dict[str, set[str]] = {}
    for group in groups:
        for word in group:
            synonyms.setdefault(word, set()).update(w for w in group if w != word)
    return {word: sorted(others) for word, others in synonyms.items() if others}


class SynonymReplacer:
    def __init__(self, rate: float = 0.1, wordnet: str | None = None, tables: dict | None = None) -> None:
        self.rate = rate
        self.tables = {code: table_synonyms(str(path)) for code, path in (tables or {}).items()}
        if wordnet is not None:
            self.tables.setdefault("en", wordnet_synonyms(str(wordnet)))
        if not self.tables:
            raise UserError("augment.synonyms needs `wordnet` (a WordNet directory) or `tables` ({language: file})")

    def __call__(self, doc: Document, rng: random.Random) -> str | None:
        language = document_language(doc)
        synonyms = self.tables.get(language)
        if synonyms is None:
            return None
        tokens = _tokens(doc.text, language)
        candidates = [i for i, t in enumerate(tokens) if t.lower() in synonyms]
        if not candidates:
            return None
        for i in rng.sample(candidates, max(1, round(self.rate * len(candidates)))):
            choice = rng.choice(synonyms[tokens[i].lower()])
            tokens[i] = choice.capitalize() if tokens[i][:1].isupper() else choice
        return "".join(tokens)


def _tokens(text: str, language: str) -> list[str]:
    """The text cut into words and what lies between them; joined, they give the text back."""
    if profile(language).segmenter == "jieba":
        return load_jieba().lcut(text)
    return _WORD_RUN.findall(text)


class BackTranslator:
    def __init__(self, models: dict, max_tokens: int = 512, device: str = "cpu") -> None:
        from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

        self.pairs, self.max_tokens, self.device = {}, max_tokens, device
        for language, paths in models.items():
            if not isinstance(paths, (list, tuple)) or len(paths) != 2:
                raise UserError(f"back_translation.models.{language} must be [to-pivot model, from-pivot model]")
            for path in paths:
                if not Path(path, "config.json").is_file():
                    raise UserError(f"back-translation model {path} is not a model directory (no config.json)")
            self.pairs[language] = [
                (AutoTokenizer.from_pretrained(p), AutoModelForSeq2SeqLM.from_pretrained(p).to(device).eval())
                for p in paths
            ]

    def __call__(self, doc: Document, rng: random.Random) -> str | None:
        pair = self.pairs.get(document_language(doc))
        if pair is None:
            return None
        text = doc.text
        for tokenizer, model in pair:
            text = self._translate(tokenizer, model, text)
            if not text:
                return None
        return text

    def _translate(self, tokenizer: "PreTrainedTokenizerBase", model: "GenerationMixin", text: str) -> str:
        import torch

        inputs = tokenizer(text, truncation=True, max_length=self.max_tokens, return_tensors="pt").to(self.device)
        with torch.no_grad():
            output = model.generate(**inputs, max_new_tokens=self.max_tokens, do_sample=False, num_beams=1)
        return tokenizer.decode(output[0], skip_special_tokens=True).strip()  # type: ignore[union-attr]


class Augmenter:
    """The `augment` config section, built: `copies(doc, counts)` gives a kept document's copies."""

    def __init__(
        self, fraction: float = 0.1, seed: int = 0, synonyms: dict | None = None, back_translation: dict | None = None
    ) -> None:
        if not 0 <= fraction <= 1:
            raise UserError(f"augment.fraction must be in [0, 1]; got {fraction}")
        self.fraction, self.seed = fraction, seed
        self.methods = [
            (name, build(**options))
            for name, build, options in (
                ("synonyms", SynonymReplacer, synonyms),
                ("back_translation", BackTranslator, back_translation),
            )
            if options is not None
        ]
        if not self.methods:
            raise UserError("augment needs `synonyms` or `back_translation` settings")

    def _draw(self, doc_id: str) -> float:
        digest = hashlib.blake2b(f"{self.seed}:{doc_id}".encode(), digest_size=8).digest()
        return int.from_bytes(digest, "little") / 2**64

    def copies(self, doc: Document, counts: Counter) -> list[Document]:
        if self._draw(doc.id) >= self.fraction:
            return []
        copies = []
        for name, method in self.methods:
            text = method(doc, random.Random(f"{self.seed}:{doc.id}:{name}"))
            if text is None or text == doc.text:
                counts[f"{name}_not_applicable"] += 1
                continue
            counts[name] += 1
            copies.append(
                Document(
                    text,
                    id=f"{doc.id}#{name}",
                    source=doc.source,
                    meta={**doc.meta, "augmented_from": doc.id, "augmentation": name},
                )
            )
        return copies
