"""Speculative decoding: prompt lookup and a draft model in the engine give greedy tokens equal to
`generate` alone, and the acceptance rule's output is distributed as the target model's."""

import pytest
import torch
from inference_fixtures import random_prompts, serve_fixtures, tiny_model
from test_serve_engine import engine_for, request, run_until_idle, tokens

from llmstack.cli.main import main
from llmstack.inference import SamplingParams, generate
from llmstack.inference.speculative import SpeculativeConfig, accept_greedy, accept_sampled, ngram_proposal

tokenizer, model = serve_fixtures()

LENGTHS = [3, 40, 17, 30, 8, 25]
NEW = [12, 6, 16, 9, 20, 5]


def repetitive_prompts():
    """Random prompts with their second half a copy of the first, so n-grams recur."""
    return [p + p for p in random_prompts([max(n // 2, 2) for n in LENGTHS], seed=11)]


def serve_all(engine, prompts, new, **kwargs):
    outputs = {}
    for i, (prompt, n) in enumerate(zip(prompts, new)):
        engine.submit(request(prompt, n, outputs, i, **kwargs))
        if i % 2 == 0:  # later requests join a batch already decoding
            engine.step()
    run_until_idle(engine)
    return [tokens(outputs[i]) for i in range(len(prompts))]


def alone(model, tokenizer, prompts, new, **kwargs):
    eos = tokenizer.eos_token_id
    return [generate(model, [p], max_new_tokens=n, eos_token_id=eos, **kwargs)[0] for p, n in zip(prompts, new)]


def sample_value(engine, name):
    return engine.metrics.registry.get_sample_value(name) or 0.0


def test_prompt_lookup_proposes_what_followed_the_latest_longest_recurrence_of_the_tail():
    assert ngram_proposal([1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 2, 3], k=2) == [7, 8]  # "2 3" recurs; latest wins
    assert ngram_proposal([5, 1, 2, 3, 4, 1, 2], k=3, ngram_max=2) == [3, 4, 1]
    assert ngram_proposal([1, 2, 3, 4], k=3) == []
    assert ngram_proposal([4, 4], k=3) == [4]
    with pytest.raises(ValueError, match="speculative tokens must be >= 1"):
        SpeculativeConfig("ngram", num_tokens=0)


def test_greedy_verification_keeps_the_matching_prefix_then_the_models_token():
    assert accept_greedy([5, 6, 7, 8], [5, 6, 9]) == [5, 6, 7]
    assert accept_greedy([5, 6, 7, 8], [5, 6, 7]) == [5, 6, 7, 8]
    assert accept_greedy([4], []) == [4]


@pytest.mark.parametrize("penalty", [1.0, 1.3])
def test_greedy_with_prompt_lookup_equals_generate_alone(model, tokenizer, penalty):
    prompts, sampling = repetitive_prompts(), SamplingParams(temperature=0.0, repetition_penalty=penalty)
    engine = engine_for(model, tokenizer, speculative=SpeculativeConfig("ngram", num_tokens=4))
    assert serve_all(engine, prompts, NEW, sampling=sampling) == alone(
        model, tokenizer, prompts, NEW, sampling=sampling
    )
    assert sample_value(engine, "llmstack_speculative_draft_tokens_total") > 0
    assert sample_value(engine, "llmstack_speculative_accepted_tokens_total") > 0


@pytest.mark.parametrize("draft_seed", [0, 1])  # seed 0: the model itself (all kept); 1: another model
def test_greedy_with_a_draft_model_equals_generate_alone(model, tokenizer, draft_seed):
    draft = tiny_model(seed=draft_seed, vocab_size=len(tokenizer), max_position_embeddings=128, num_hidden_layers=2)
    prompts = random_prompts(LENGTHS, seed=12)
    engine = engine_for(model, tokenizer, speculative=SpeculativeConfig("draft", num_tokens=3), draft=draft)
    assert serve_all(engine, prompts, NEW) == alone(model, tokenizer, prompts, NEW)
    proposed = sample_value(engine, "llmstack_speculative_draft_tokens_total")
    accepted = sample_value(engine, "llmstack_speculative_accepted_tokens_total")
    assert proposed > 0 and (accepted == proposed if draft_seed == 0 else accepted < proposed)


def test_sampled_speculation_serves_every_token_asked_for(model, tokenizer):
    draft = tiny_model(seed=1, vocab_size=len(tokenizer), max_position_embeddings=128)
    engine = engine_for(model, tokenizer, speculative=SpeculativeConfig("draft", num_tokens=3), draft=draft)
    sampling = SamplingParams(temperature=0.9, top_k=40, repetition_penalty=1.1)
    outputs = serve_all(engine, random_prompts(LENGTHS, seed=13), NEW, sampling=sampling, seed=5, ignore_eos=True)
    assert [len(o) for o in outputs] == NEW


def test_a_draft_model_with_another_vocabulary_is_refused(model, tokenizer):
    draft = tiny_model(vocab_size=len(tokenizer) + 8)
    with pytest.raises(ValueError, match="must share the tokenizer"):
        engine_for(model, tokenizer, speculative=SpeculativeConfig("draft"), draft=draft)


# The acceptance rule on a 3-token vocabulary: target and draft are two bigram models (the next
# token's distribution depends on the previous token), and speculative sampling of 3-token
# sequences must give the target's distribution over all 27 sequences. Pearson's chi-square
# statistic of N samples against the exact probabilities, with 26 degrees of freedom, exceeds
# 54.05 with probability 0.001 when the rule is right (scipy.stats.chi2.ppf(0.999, 26)); each of
# the seeds must stay below it, so a correct rule fails this test with probability below 0.5%.
# The same test of the draft's own distribution (the rule skipped) scores far above it.
VOCAB, LENGTH, SAMPLES, CRITICAL = 3, 3, 3000, 54.05
TARGET = torch.tensor([[0.6, 0.3, 0.1], [0.2, 0.2, 0.6], [0.1, 0.5, 0.4]])
DRAFT = torch.tensor([[0.2, 0.5, 0.3], [0.4, 0.4, 0.2], [0.3, 0.3, 0.4]])
START = 0


def speculative_sample(generator, draft_probs_known=True, k=2):
    sequence = [START]
    while len(sequence) <= LENGTH:
        guesses, dists = [], []
        for _ in range(k):
            dist = DRAFT[(guesses or sequence)[-1]]
            guesses.append(int(torch.multinomial(dist, 1, generator=generator)))
            dists.append(dist)
        context = sequence + guesses
        target = TARGET[torch.tensor(context[len(sequence) - 1 :])]  # after each prefix of the guesses
        q = torch.stack(dists) if draft_probs_known else None
        sequence += accept_sampled(target, guesses, q, generator)
    return tuple(sequence[1 : LENGTH + 1])


def exact_probability(sequence):
    p, previous = 1.0, START
    for token in sequence:
        p, previous = p * float(TARGET[previous, token]), token
    return p


def chi_square(samples):
    counts = {}
    for s in samples:
        counts[s] = counts.get(s, 0) + 1
    cells = [(a, b, c) for a in range(VOCAB) for b in range(VOCAB) for c in range(VOCAB)]
    expected = [SAMPLES * exact_probability(s) for s in cells]
    return sum((counts.get(s, 0) - e) ** 2 / e for s, e in zip(cells, expected))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_speculative_sampling_is_distributed_as_the_target_model(seed):
    generator = torch.Generator().manual_seed(seed)
    assert chi_square([speculative_sample(generator) for _ in range(SAMPLES)]) < CRITICAL


def test_a_point_mass_proposal_keeps_the_target_distribution():
    """Prompt lookup's guesses are deterministic: q is a point mass on the guess."""
    generator = torch.Generator().manual_seed(3)
    counts = torch.zeros(VOCAB)
    for _ in range(SAMPLES):
        counts[accept_sampled(TARGET[[0, 1]], [1], None, generator)[0]] += 1
    expected = SAMPLES * TARGET[0]
    assert float(((counts - expected) ** 2 / expected).sum()) < 13.82  # chi2.ppf(0.999, 2)


def test_the_chi_square_check_tells_the_draft_distribution_apart():
    generator = torch.Generator().manual_seed(0)

    def draft_only():
        sequence = [START]
        for _ in range(LENGTH):
            sequence.append(int(torch.multinomial(DRAFT[sequence[-1]], 1, generator=generator)))
        return tuple(sequence[1:])

    assert chi_square([draft_only() for _ in range(SAMPLES)]) > 10 * CRITICAL


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tokenizer):
    root = tmp_path_factory.mktemp("spec-cli")
    tokenizer.save_pretrained(root)
    tiny_model(vocab_size=len(tokenizer)).save_pretrained(root)
    return root


def test_generate_speculative_prints_what_plain_greedy_generate_prints(model_dir, capsys):
    prompts = ["def add(a, b):\n    return a + b\ndef add(a, b):", "The quick brown fox. The quick"]
    argv = ["generate", "--model", str(model_dir), "--temperature", "0", "--max-new-tokens", "12", "--output", "jsonl"]
    argv += [a for p in prompts for a in ("--prompt", p)]
    assert main(argv) == 0
    plain = capsys.readouterr().out
    for extra in (["--speculative", "ngram"], ["--speculative", "draft", "--draft-model", str(model_dir)]):
        assert main([*argv, *extra, "--speculative-tokens", "3"]) == 0
        assert capsys.readouterr().out == plain
    one = ["generate", "--model", str(model_dir), "--temperature", "0", "--max-new-tokens", "12", "--prompt", "def"]
    assert main(one) == 0
    streamed = capsys.readouterr().out
    assert main([*one, "--speculative", "ngram"]) == 0
    assert capsys.readouterr().out == streamed


def test_speculative_options_that_cannot_work_are_user_errors(model_dir, capsys):
    argv = ["generate", "--model", str(model_dir), "--prompt", "x"]
    assert main([*argv, "--speculative", "draft"]) == 2
    assert "needs --draft-model" in capsys.readouterr().err
    assert main([*argv, "--draft-model", str(model_dir)]) == 2
    assert "needs --speculative draft" in capsys.readouterr().err
    assert main([*argv, "--speculative", "ngram", "--speculative-tokens", "0"]) == 2
    assert "must be >= 1" in capsys.readouterr().err
    assert main(["serve", str(model_dir), "--speculative", "draft"]) == 2  # refused before the model loads
    assert "needs --draft-model" in capsys.readouterr().err
