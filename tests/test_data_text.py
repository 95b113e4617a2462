"""Normalization, language identification, blocklists and the perplexity filter."""

import math
from collections import Counter

import pytest
import torch

from llmstack.data.blocklist import url_blocklist, word_blocklist
from llmstack.data.document import Document
from llmstack.data.langid import CLD2Detector, LangdetectDetector, LinguaDetector, language_filter, load_detector
from llmstack.data.normalize import normalize, normalize_text
from llmstack.errors import UserError

ENGLISH = "The children walked along the river to the old mill, where their grandfather used to work."
GERMAN = "Die Kinder gingen am Fluss entlang zur alten Mühle, wo ihr Großvater früher gearbeitet hat."


def test_normalize_repairs_mojibake_nfc_controls_and_whitespace():
    assert normalize_text("CafÃ© crÃ¨me") == "Café crème"
    assert normalize_text("cafe\u0301") == "café"  # NFC
    assert normalize_text("a\x00b\u200bc\x07d") == "abcd"
    assert normalize_text("  one\u00a0two  \r\n\r\n\r\n\r\n    indented   \n") == "one two\n\n    indented"
    assert normalize_text("“quoted” ＡＢ") == "“quoted” AB"  # quotes are content; full-width letters fold
    assert normalize_text("ＡＢ", fold_widths=False) == "ＡＢ"


def test_width_folding_keeps_cjk_punctuation():
    assert normalize_text("型号ＸＹ－１２３，价格９９元。ｶﾞｲﾄﾞ") == "型号XY－123，价格99元。ガイド"


def test_normalize_stage_counts_changes_and_drops_noise_only_documents():
    counts = Counter()
    doc = Document("x  \n")
    assert normalize(doc, counts) is None and doc.text == "x" and counts["changed"] == 1
    assert normalize(Document("\u200b \x00\n\n"), counts) == "empty"


@pytest.mark.parametrize("detector", [CLD2Detector, LinguaDetector, LangdetectDetector])
def test_detectors_name_the_language(detector):
    model = detector()
    assert model.detect(ENGLISH)[0] == "en" and model.detect(GERMAN)[0] == "de"
    assert model.detect("12345 67")[1] == 0.0


def test_language_filter_threshold_and_target_languages():
    score = LinguaDetector().detect(ENGLISH)[1]
    doc = Document(ENGLISH)
    assert language_filter(threshold=score - 1e-9, detector="lingua")(doc, Counter()) is None
    assert doc.meta["language"] == "en" and doc.meta["language_score"] == pytest.approx(score, abs=1e-4)
    assert (
        language_filter(threshold=score + 1e-9, detector="lingua")(Document(ENGLISH), Counter()) == "low_language_score"
    )
    assert (
        language_filter(threshold=1.0, thresholds={"en": score - 1e-9}, detector="lingua")(Document(ENGLISH), Counter())
        is None
    )
    assert language_filter()(Document(GERMAN), Counter()) == "other_language"
    assert language_filter(languages=["de", "en"])(Document(GERMAN), Counter()) is None


def test_detector_plugins_by_import_path_and_unknown_names():
    assert isinstance(load_detector("llmstack.data.langid:LangdetectDetector"), LangdetectDetector)
    with pytest.raises(UserError, match="unknown language detector"):
        load_detector("nope")


def test_word_blocklist(tmp_path):
    path = tmp_path / "words.txt"
    path.write_text("# comment\nbadword\nvery bad phrase\n")
    stage = word_blocklist(path)
    assert stage(Document("a BadWord here"), Counter()) == "blocked_words"
    assert stage(Document("a very  bad phrase"), Counter()) is None  # phrases match exactly
    assert stage(Document("a Very bad phrase."), Counter()) == "blocked_words"
    assert stage(Document("badwords and notbadword are other words"), Counter()) is None
    assert word_blocklist(path, min_matches=2)(Document("badword once"), Counter()) is None
    with pytest.raises(UserError, match="cannot read"):
        word_blocklist(tmp_path / "missing.txt")


def test_url_blocklist_matches_domains_and_subdomains(tmp_path):
    path = tmp_path / "domains.txt"
    path.write_text("spam.example\n")
    stage = url_blocklist(path)
    for url, expected in [
        ("https://spam.example/page", "blocked_url"),
        ("http://www.SPAM.example:8080/x", "blocked_url"),
        ("spam.example/a", "blocked_url"),
        ("https://notspam.example/", None),
        ("https://spam.example.org/", None),
    ]:
        assert stage(Document("text", meta={"url": url}), Counter()) == expected, url
    assert stage(Document("no url"), Counter()) is None


def test_perplexity_filter_scores_with_the_reference_model(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from llmstack.data.perplexity import perplexity_filter
    from llmstack.models import LLMStackConfig, LLMStackForCausalLM

    byte_level = Tokenizer(models.BPE())
    byte_level.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    byte_level.add_tokens([chr(c) for c in range(32, 127)])
    PreTrainedTokenizerFast(tokenizer_object=byte_level).save_pretrained(tmp_path)
    torch.manual_seed(0)
    config = LLMStackConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=128,
    )
    model = LLMStackForCausalLM(config).eval()
    model.save_pretrained(tmp_path)

    text = "the cat sat on the mat"
    ids = PreTrainedTokenizerFast.from_pretrained(tmp_path)(text, return_tensors="pt").input_ids
    with torch.no_grad():
        log_probs = model(ids).logits[0, :-1].log_softmax(-1)
    expected = math.exp(-log_probs.gather(1, ids[0, 1:, None]).mean().item())

    doc = Document(text)
    assert perplexity_filter(tmp_path, max_perplexity=expected * 1.001)(doc, Counter()) is None
    assert doc.meta["perplexity"] == pytest.approx(expected, rel=1e-3)
    assert perplexity_filter(tmp_path, max_perplexity=expected * 0.999)(Document(text), Counter()) == "high_perplexity"
    with pytest.raises(UserError, match="not a model directory"):
        perplexity_filter(tmp_path / "missing", max_perplexity=10)
