"""Mixture weight schedules (data.schedule) and reweighting across a resume: each source's share of
the tokens follows its scheduled share within 5% (relative) over every 100-step window, a resume
mid-schedule continues the uninterrupted run (on another data-parallel size too, for packed
shards), and a resume with other weights or sources trains no sample or document of any source
twice and skips none of them."""

import json
import re
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from test_data_mixture import mean_length_corpus, mixture_texts, packed_sources  # noqa: F401 (a fixture)
from test_data_stream import corpus, documents_of, take  # noqa: F401 (a fixture)

from llmstack.data.blocks import MixedBlocks
from llmstack.data.mixture import WeightSchedule
from llmstack.data.stream import MixtureStream
from llmstack.data.tokenizer import train_tokenizer
from llmstack.errors import UserError
from llmstack.training.config import parse_run_config
from llmstack.training.trainer import build_train_data

START = {"long": 0.5, "medium": 0.3, "short": 0.2}
SCHEDULES = {
    # anneal towards the short-document source over the second half of 300 steps
    "linear": {
        "interpolation": "linear",
        "points": [
            {"step": 150, "weights": START},
            {"step": 300, "weights": {"long": 0.2, "medium": 0.2, "short": 0.6}},
        ],
    },
    "step": {
        "interpolation": "step",
        "points": [
            {"step": 100, "weights": {"long": 0.3, "medium": 0.2, "short": 0.5}},
            {"step": 200, "weights": {"long": 0.2, "medium": 0.5, "short": 0.3}},
        ],
    },
}
STEPS = 300


def scheduled_windows_deviation(per_step, schedule, window=100):
    """The largest |tokens / scheduled tokens - 1| of any source over every window of `window`
    steps; `per_step`: each step's tokens by source, the schedule's integral the scheduled share."""
    worst = 0.0
    for start in range(len(per_step) - window + 1):
        totals = Counter()
        for step in per_step[start : start + window]:
            totals.update(step)
        total = sum(totals.values())
        expected = (schedule.integral(start + window) - schedule.integral(start)) / window
        worst = max(worst, *(abs(totals[s] / total / e - 1) for s, e in zip(schedule.names, expected)))
    return worst


def stream_tokens_per_step(stream, steps, micro=4, state=None, consumed=0):
    """Each step's tokens by source (steps of one micro-batch on one rank)."""
    if state is not None:
        stream.load_state_dict(state)
    batches, per_step, before = stream.micro_batches(consumed, micro, 0, 1), [], Counter(stream.source_tokens)
    for _ in range(steps):
        next(batches)
        now = Counter(stream.source_tokens)
        per_step.append(now - before)
        before = now
    return per_step


@pytest.fixture(scope="module")
def lengths_corpus(tmp_path_factory):
    """Sources whose mean document lengths are 120, 30 and 6 words, and a tokenizer of their words."""
    root = tmp_path_factory.mktemp("schedule")
    mean_length_corpus(root, seed=0)
    tokenizer = train_tokenizer(mixture_texts(), 300, root / "tokenizer")
    return [{"name": s, "paths": str(root / f"{s}.jsonl"), "weight": w} for s, w in START.items()], tokenizer


@pytest.mark.parametrize("kind", ["linear", "step"])
def test_a_stream_follows_its_schedule_in_every_100_step_window(lengths_corpus, kind):
    """Mean document lengths 20x apart, 4 x 64 tokens a step: every window of 100 steps gives each
    source its scheduled share of the tokens within 5% (relative)."""
    sources, tokenizer = lengths_corpus
    stream = MixtureStream(sources, tokenizer, seq_len=64, schedule=SCHEDULES[kind], samples_per_step=4)
    per_step = stream_tokens_per_step(stream, STEPS)
    assert scheduled_windows_deviation(per_step, stream.schedule) < 0.05
    last = Counter()
    for step in per_step[-20:]:
        last.update(step)
    assert last["short"] / sum(last.values()) == pytest.approx(stream.schedule.at(STEPS)[2], rel=0.1)


def test_a_stream_resumed_mid_schedule_continues_the_uninterrupted_run(lengths_corpus):
    """Saved at step 170 (in the ramp), resumed from the state and, as on another tensor/pipeline
    layout, from another rank's state (replayed): the same batches as the uninterrupted run."""
    sources, tokenizer = lengths_corpus

    def stream():
        return MixtureStream(sources, tokenizer, seq_len=64, schedule=SCHEDULES["linear"], samples_per_step=4)

    uninterrupted = take(stream().micro_batches(0, 4, 0, 1), 260)
    first = stream()
    take(first.micro_batches(0, 4, 0, 1), 170)
    state = json.loads(json.dumps(first.state_dict()))
    resumed = stream()
    resumed.load_state_dict(state)
    other_rank = stream()
    other_rank.load_state_dict({**state, "dp_rank": 1})  # not this rank's place: replayed
    for got in (take(resumed.micro_batches(680, 4, 0, 1), 90), take(other_rank.micro_batches(680, 4, 0, 1), 90)):
        assert all(torch.equal(a, b) for a, b in zip(uninterrupted[170:], got, strict=True))
    assert resumed.source_tokens == other_rank.source_tokens


@pytest.mark.parametrize("kind", ["linear", "step"])
def test_a_packed_mixture_follows_its_schedule_and_resumes_on_another_data_parallel_size(packed_sources, kind):  # noqa: F811 (the imported fixture)
    """8 samples a step: every 100-step window within 5% of the schedule; saved on one rank at step
    130, resumed on four (2 samples each a micro-batch): the uninterrupted samples."""

    def mixture():
        return MixedBlocks(packed_sources, seq_len=16, seed=3, schedule=SCHEDULES[kind], samples_per_step=8)

    whole = mixture()
    order = [whole.names[whole.period.item(i)[0]] for i in range(STEPS * 8)]
    per_step = [Counter(order[k : k + 8]) for k in range(0, len(order), 8)]
    assert scheduled_windows_deviation(per_step, whole.schedule) < 0.05
    uninterrupted = torch.cat(take(whole.micro_batches(0, 8, 0, 1), 160))
    saved = json.loads(json.dumps(whole.state_dict()))
    ranks = []
    for r in range(4):
        resumed = mixture()
        resumed.load_state_dict(saved)
        ranks.append(take(resumed.micro_batches(130 * 8, 2, r, 4), 30))
    assert torch.equal(uninterrupted[130 * 8 :], torch.cat([ranks[r][k] for k in range(30) for r in range(4)]))


def source_order(mixture, start, stop):
    """(source name, the source's own sample index) of global samples [start, stop)."""
    return [(mixture.names[s], k) for s, k in map(mixture.period.item, range(start, stop))]


def test_a_packed_mixture_reweighted_on_resume_trains_each_sample_once(packed_sources):  # noqa: F811 (the imported fixture)
    """Saved as long/medium 0.5/0.5 at sample 800 (the step size changing too), resumed as
    long/short 0.2/0.8: every source's samples stay in its own order with none repeated or
    skipped (long goes on, short starts at its first, medium stops), the new weights hold from
    the resume on, and the samples are the blocks of those sources."""
    by_name = {s["name"]: s for s in packed_sources}
    before = MixedBlocks([{**by_name["long"], "weight": 1}, {**by_name["medium"], "weight": 1}], 16, samples_per_step=8)
    take(before.micro_batches(0, 8, 0, 1), 100)
    saved = json.loads(json.dumps(before.state_dict()))
    after = MixedBlocks(
        [{**by_name["long"], "weight": 0.2}, {**by_name["short"], "weight": 0.8}], 16, samples_per_step=4
    )
    after.load_state_dict(saved)
    blocks = torch.cat(take(after.micro_batches(800, 4, 0, 1), 500))
    trained = source_order(before, 0, 800) + source_order(after, 800, 2800)
    for name in ("long", "medium", "short"):
        mine = [k for n, k in trained if n == name]
        assert mine == list(range(len(mine))), name
    assert Counter(n for n, _ in trained[800:]) == {"long": 400, "short": 1600}
    assert after.source_samples(2800) == {"long": 400 + 400, "short": 1600}
    parts = dict(zip(after.names, after.parts))
    assert all(np.array_equal(b.numpy(), parts[n].sample(k)) for b, (n, k) in zip(blocks, trained[800:], strict=True))
    moved = MixedBlocks([{**by_name["short"], "name": "long"}], 16)
    moved.load_state_dict(saved)
    with pytest.raises(UserError, match="a source keeps its prefixes under its name"):
        next(moved.micro_batches(800, 4, 0, 1))


def test_a_stream_resumed_with_a_schedule_it_did_not_have_switches_at_the_resume(corpus):  # noqa: F811 (the imported fixture)
    """A stream saved without a schedule and resumed with one: every source's documents stay in
    their own order across the resume, none twice or left out."""
    root, tokenizer = corpus
    sources = [{"name": s, "paths": str(root / f"{s}-*.jsonl"), "weight": 1} for s in ("web", "books")]
    before = MixtureStream(sources, tokenizer, seq_len=16)
    first = take(before.micro_batches(0, 2, 0, 1), 30)
    schedule = {"interpolation": "step", "points": [{"step": 40, "weights": {"books": 1}}]}
    after = MixtureStream(sources, tokenizer, seq_len=16, schedule=schedule, samples_per_step=2)
    after.load_state_dict(json.loads(json.dumps(before.state_dict())))
    second = take(after.micro_batches(60, 2, 0, 1), 40)
    docs = documents_of(first + second, tokenizer)
    own_order = [(f, d) for f in range(4) for d in range(60)] * 3
    for source in ("web", "books"):
        mine = [(f, d) for s, f, d in docs if s == source]
        assert mine == own_order[: len(mine)], source
    web_before = sum(s == "web" for s, _, _ in documents_of(first, tokenizer))
    assert sum(s == "web" for s, _, _ in docs) > web_before + 1  # both until step 40
    assert {s for s, _, _ in docs[-40:]} == {"books"}  # then books alone


@pytest.mark.parametrize(
    "schedule, message",
    [
        ({"points": [{"step": 5, "weights": {"wiki": 1}}]}, r"names 'wiki', not a source of this mixture"),
        ({"points": [{"step": 5, "weights": {"web": 0, "code": 0}}]}, r"weights must sum to more than 0"),
        (
            {"points": [{"step": 5, "weights": {"web": 1}}, {"step": 5, "weights": {"code": 1}}]},
            r"points\[1\].step must be a whole number >= 0, greater than the step before it; got 5",
        ),
        ({"interpolation": "cosine", "points": []}, r"interpolation must be one of linear, step"),
        ({"points": []}, r"points must be a non-empty list"),
        ({"points": [{"step": 1, "weights": {"web": -1}}]}, r"weights.web must be a number >= 0"),
        ({"every": 10}, r" must be a mapping {interpolation"),
    ],
)
def test_a_bad_schedule_is_one_error_before_start_up(schedule, message):
    data = {"tokenizer": "tok", "sources": [{"name": "web", "paths": "x"}, {"name": "code", "paths": "y"}]}
    with pytest.raises(UserError, match=r"run config: data.schedule.*" + message):
        parse_run_config({"model": {}, "data": {**data, "schedule": schedule}})


def test_a_schedule_needs_named_sources_weighed_by_tokens_in_a_stream():
    schedule = {"points": [{"step": 5, "weights": {"a": 1}}]}
    with pytest.raises(UserError, match="data.schedule weighs named sources"):
        parse_run_config({"model": {}, "data": {"tokenizer": "tok", "train": ["p"], "schedule": schedule}})
    sources = [{"name": "a", "paths": "x"}]
    data = {"tokenizer": "tok", "sources": sources, "schedule": schedule, "weight_by": "documents"}
    with pytest.raises(UserError, match="use data.weight_by: tokens"):
        parse_run_config({"model": {}, "data": data})
    train = [{"name": "a", "prefixes": ["p"]}]
    config = parse_run_config({"model": {}, "data": {"tokenizer": "tok", "train": train, "schedule": schedule}})
    assert config.data.schedule == schedule


def docs_example():
    """The run config snippet of docs/data.md's weight-schedule section, as written there."""
    text = (Path(__file__).parents[1] / "docs" / "data.md").read_text()
    section = text[text.index("## Weight schedules") :]
    return yaml.safe_load(re.search(r"```yaml\n(.*?)```", section, re.S).group(1))


def test_the_documented_schedule_anneals_to_wiki_over_the_last_10_percent(tmp_path, monkeypatch):
    """The snippet as written (short sequences and micro-batches, to run in a second), 1000 steps:
    wiki has 10% of the tokens over the first 900 steps and its scheduled share of the last 100."""
    raw = docs_example()
    raw["data"]["seq_len"], raw["train"]["micro_batch_size"] = 16, 1
    monkeypatch.chdir(tmp_path)
    for name, sentence in (("web", "a page of the web"), ("wiki", "an article of wiki")):
        Path(name).mkdir()
        with open(f"{name}/part-0.jsonl", "w") as out:
            out.writelines(json.dumps({"text": f"{sentence} {i}"}) + "\n" for i in range(200))
    tokenizer = train_tokenizer((f"a page of the web an article of wiki {i}" for i in range(50)), 300, "tokenizer")
    config = parse_run_config(raw)
    micro = config.train.micro_batch_size
    stream = build_train_data(config.data, tokenizer, samples_per_step=micro)
    plan = WeightSchedule.from_config(config.data.schedule, ["web", "wiki"], [0.9, 0.1], "docs")
    assert plan.at(0).tolist() == pytest.approx([0.9, 0.1]) and plan.at(900).tolist() == pytest.approx([0.9, 0.1])
    assert plan.at(950).tolist() == pytest.approx([0.55, 0.45]) and plan.at(1000).tolist() == pytest.approx([0.2, 0.8])
    per_step = stream_tokens_per_step(stream, config.train.max_steps, micro=micro)
    shares = [
        sum(s["wiki"] for s in part) / sum(sum(s.values()) for s in part) for part in (per_step[:900], per_step[900:])
    ]
    expected = [0.1, float(plan.integral(1000)[1] - plan.integral(900)[1]) / 100]
    assert shares == pytest.approx(expected, rel=0.05)


def test_weight_schedule_integrals_and_their_inverse():
    plan = WeightSchedule.from_config(SCHEDULES["linear"], list(START), list(START.values()), "s")
    steps = np.linspace(0, 400, 81)
    for s in range(3):
        integral = np.array([plan.integral(x)[s] for x in steps])
        assert np.allclose(plan.reaching(s, integral[1:]), steps[1:])
    values = np.array([plan.at(x) for x in np.linspace(0, 300, 3001)])
    assert np.allclose(plan.integral(300), (values[1:] + values[:-1]).sum(axis=0) * 0.1 / 2)  # trapezoids
    assert all(v == pytest.approx(1.0) for v in [sum(plan.at(x)) for x in steps])
    off = WeightSchedule.from_config(
        {"interpolation": "step", "points": [{"step": 10, "weights": {"long": 1}}]}, list(START), [1, 1, 1], "s"
    )
    assert off.reaching(1, np.array([3.0, 3.4])).tolist() == [pytest.approx(9.0), np.inf]  # medium stops at step 10


def test_the_order_of_a_packed_mixture_does_not_depend_on_its_chunk(packed_sources):  # noqa: F811 (the imported fixture)
    small, large = (
        MixedBlocks(packed_sources, 16, schedule=SCHEDULES["step"], samples_per_step=8, chunk=c) for c in (7, 4096)
    )
    assert source_order(small, 0, 2400) == source_order(large, 0, 2400)
    assert small.source_samples(2399) == large.source_samples(2399)
