"""Augmentation: synonym replacement (WordNet from Debian's wordnet-base; a user's table for other
languages), back-translation through tiny seq2seq models built here; copies tagged, capped, left
out of dedup against their sources and dropped with them."""

import json
import random
from collections import Counter
from pathlib import Path

import pytest
import torch
from test_data_pipeline import prose

from llmstack.data.augment import Augmenter, SynonymReplacer, wordnet_synonyms
from llmstack.data.document import Document
from llmstack.data.pipeline import cleaned_files, run_pipeline
from llmstack.data.tokenizer import train_tokenizer
from llmstack.errors import UserError

WORDNET = Path("/usr/share/wordnet")
ZH_TABLE = "# 同义词\n快乐 高兴 愉快\n美丽 漂亮\n城市 都市\n"
ZH_TEXT = "这个城市很美丽，人们每天都很快乐。"


# Synsets copied in WordNet 3's data-file format (licence header, offset, lexfile, pos, hex lemma
# count, lemma/lex_id pairs, pointers), for machines without Debian's wordnet-base.
WORDNET_LINES = {
    "data.noun": "  1 This software and database is being provided ...\n"
    "02958343 06 n 05 car 0 auto 0 automobile 0 machine 1 motorcar 0 000 | a motor vehicle\n"
    "03544360 06 n 02 house 0 home 0 000 | a dwelling\n",
    "data.verb": "01928838 38 v 03 jump 0 leap 0 bound 0 000 | move forward by leaps\n",
    "data.adj": "01382086 00 a 03 big 0 large 0 prominent 0 000 | above average in size\n"
    "01041916 00 s 02 quick 0 speedy 0 000 | moving quickly\n",
    "data.adv": "00157020 02 r 02 near 0 nigh 0 000 | near in space\n",
}


@pytest.fixture
def wordnet_dir(tmp_path):
    """Debian's WordNet where it is installed (CI installs it), else the synsets above in its format."""
    if (WORDNET / "data.noun").is_file():
        return WORDNET
    for name, text in WORDNET_LINES.items():
        (tmp_path / name).write_text(text, encoding="latin-1")
    return tmp_path


def test_wordnet_synonyms_replace_english_words(wordnet_dir):
    synonyms = wordnet_synonyms(str(wordnet_dir))
    assert "automobile" in synonyms["car"] and "car" in synonyms["automobile"]
    text = "The quick brown fox jumps over the lazy dog near the big house."
    replaced = SynonymReplacer(rate=0.5, wordnet=str(wordnet_dir))(
        Document(text, meta={"language": "en"}), random.Random(0)
    )
    assert replaced != text and len(replaced.split()) >= len(text.split())


def test_a_users_table_gives_chinese_synonyms(tmp_path):
    (tmp_path / "zh.txt").write_text(ZH_TABLE, encoding="utf-8")
    replacer = SynonymReplacer(rate=1.0, tables={"zh": str(tmp_path / "zh.txt")})
    assert replacer(Document(ZH_TEXT), random.Random(0)) == "这个都市很漂亮，人们每天都很高兴。"
    assert replacer(Document("No table for English."), random.Random(0)) is None
    with pytest.raises(UserError, match="synonym table"):
        SynonymReplacer(tables={"zh": str(tmp_path / "missing.txt")})


def test_copies_are_capped_tagged_kept_by_dedup_and_dropped_with_their_source(tmp_path):
    (tmp_path / "en.txt").write_text("family household\nsold vended\nflour meal\n", encoding="utf-8")
    texts = [prose(i) for i in range(40)] + [prose(3)]  # the last one: an exact duplicate of document 3
    (tmp_path / "in.jsonl").write_text(
        "".join(json.dumps({"id": f"d{i}", "text": t}) + "\n" for i, t in enumerate(texts))
    )
    augment = {"fraction": 0.25, "seed": 1, "synonyms": {"rate": 1.0, "tables": {"en": str(tmp_path / "en.txt")}}}
    config = {
        "inputs": [{"paths": [str(tmp_path / "in.jsonl")]}],
        "output": str(tmp_path / "out"),
        "dedup": {"exact": True, "near": {}},
        "augment": augment,
    }
    stats = run_pipeline(config, show=lambda _: None)
    clean = [json.loads(line) for p in cleaned_files(tmp_path / "out") for line in Path(p).read_text().splitlines()]
    copies = [d for d in clean if "augmented_from" in d.get("meta", {})]
    chosen = Augmenter(**augment)
    expected = [f"d{i}" for i in range(40) if chosen._draw(f"d{i}") < 0.25]
    assert [d["meta"]["augmented_from"] for d in copies] == expected and 0 < len(expected) <= 0.4 * 40
    assert all(
        d["id"] == d["meta"]["augmented_from"] + "#synonyms"
        and d["meta"]["augmentation"] == "synonyms"
        and "sold" not in d["text"]
        and "vended" in d["text"]
        for d in copies
    )
    assert stats["augment"].counts["synonyms"] == len(expected) + (chosen._draw("d40") < 0.25)
    assert stats["dedup"].drops["exact_duplicate"] == 1
    assert stats["dedup"].drops.get("source_dropped", 0) == (chosen._draw("d40") < 0.25)


def tiny_translator(path, seed):
    """A random 1-layer T5 with a byte-level tokenizer that never ends a sentence early."""
    from transformers import T5Config, T5ForConditionalGeneration

    tokenizer = train_tokenizer([prose(i) for i in range(20)], 300, path)
    torch.manual_seed(seed)
    config = T5Config(
        vocab_size=len(tokenizer),
        d_model=16,
        d_kv=8,
        d_ff=32,
        num_layers=1,
        num_decoder_layers=1,
        num_heads=2,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        decoder_start_token_id=tokenizer.pad_token_id,
    )
    model = T5ForConditionalGeneration(config)
    model.generation_config.min_new_tokens = 8  # a random model might end at once
    model.save_pretrained(path)
    return path


def test_back_translation_through_two_models(tmp_path):
    models = [str(tiny_translator(tmp_path / "to", 0)), str(tiny_translator(tmp_path / "back", 1))]
    augmenter = Augmenter(fraction=1.0, back_translation={"models": {"en": models}, "max_tokens": 12})
    counts = Counter()
    doc = Document(prose(0), id="d0", meta={"language": "en"})
    (copy,) = augmenter.copies(doc, counts)
    assert copy.meta == {"language": "en", "augmented_from": "d0", "augmentation": "back_translation"}
    assert copy.text and copy.text != doc.text and counts == Counter(back_translation=1)
    assert augmenter.copies(Document(ZH_TEXT, id="z", meta={"language": "zh"}), counts) == []  # no models for zh
    with pytest.raises(UserError, match="to-pivot"):
        Augmenter(back_translation={"models": {"en": models[:1]}})
