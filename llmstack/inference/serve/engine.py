"""Continuous batching: a scheduler that admits waiting requests into the running decode batch at
every step and retires finished ones, over a slotted KV cache.

Each step (1) drops cancelled requests, (2) admits waiting requests in arrival order while the
batch has a free slot (a request that finds none waits; a slot holds a whole context, so no
request is ever preempted) and plans which prompt tokens to prefill, and (3) runs one forward
over the step's new tokens packed in one row, as vLLM flattens a step: the prefills' prompt
tokens, then each running sequence's last token (and speculative guesses). Projections, norms
and MLPs run once over all of them; attention is split per group (`PackedView`): a prefill
against its slot, causally, the running rows against theirs. Then each prompt the step
completes samples its first token, and each running sequence emits its next tokens.

Chunked prefill (`chunked_prefill_size`, SGLang's name for it; 0 turns it off) caps the prompt
tokens computed in a step: the step prefills whole prompts while they fit in the budget and then
one chunk of the next prompt, whose remaining chunks come first in the following steps. A
partly prefilled prompt waits at the head of the queue, holding the last slot of the cache (the
running sequences hold 0..n-1, n < slots), where each chunk writes its keys/values at its own
positions and attends to the prompt's earlier chunks and, causally, to itself; when its last chunk
is done it moves to slot n and joins the batch. So a long prompt's arrival adds one chunk's
tokens to each step's forward instead of stalling the running requests for the whole prompt.
Without chunking, admission stops when the admitted prompts pass `max_prefill_tokens` (at least
one is admitted) and each is prefilled whole. With a prefix cache, a prompt that shares more
blocks with a prompt completed in the same step than the cache holds for it waits a step
(the blocks are stored after the forward) and reuses them then.

Each group's attention gets the shapes and mask a forward of its own would give it: a prompt
attends as `generate` prefills it alone, and each running sequence only to its own cached keys
(masked), so a request's greedy tokens are those `llmstack generate` gives it alone (up to float
near-ties: the token-wise matmuls round by the packed row's size).
The running sequences occupy slots 0..n-1 in order; when one ends, the last takes its slot.

The engine runs in a thread of its own (`start`); `submit` and `abort` are safe from any thread,
and each request's events are delivered through its `on_event` callback from the engine thread.
"""

import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from ..sampling import GREEDY, SamplingParams, next_token, probabilities
from ..speculative import SpeculativeConfig, accept_greedy, accept_sampled, ngram_proposal
from ..structured import Grammar, GrammarError, GrammarTokenizer, Matcher
from ..text_stream import IncrementalText
from .draft import DraftInput, DraftModel
from .kv_cache import CacheView, PackedView, SlotKVCache
from .metrics import ServeMetrics
from .prefix_cache import PrefixCache

log = logging.getLogger(__name__)


class RequestRejected(ValueError):
    """The request can never be served as asked (too long for the context or the cache);
    `param` names the request field at fault."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


class QueueFull(RuntimeError):
    """Too many requests are waiting; the client should retry later."""


@dataclass(frozen=True)
class Event:
    """What a request produced since its last event. `finish_reason` is set on its last event:
    "stop" (EOS or a stop string), "length" (max_tokens), "abort" (cancelled) or "error"."""

    text: str
    token_ids: tuple[int, ...]
    completion_tokens: int
    finish_reason: str | None = None
    error: str | None = None


@dataclass
class GenerationRequest:
    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams = GREEDY
    stop: tuple[str, ...] = ()
    seed: int | None = None
    ignore_eos: bool = False
    on_event: Callable[[Event], object] = lambda event: None
    grammar: Grammar | None = None  # constrains the output (structured output); no speculation then
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    arrival: float = field(default_factory=time.monotonic)


@dataclass
class Sequence:
    """A request's state while it runs: tokens so far and sampling state. Its cache slot is its
    index in the engine's running list."""

    request: GenerationRequest
    text: IncrementalText
    seen: torch.Tensor  # (1, vocab) tokens seen so far, for the repetition penalty
    generator: torch.Generator | None
    matcher: Matcher | None = None
    output: list[int] = field(default_factory=list)
    prefilled: int = 0  # prompt tokens in the cache while the prompt is prefilled in chunks
    sent: int = 0  # outputs already delivered in events
    last_token_time: float | None = None

    def event(self, text: str, finish_reason: str | None = None, error: str | None = None) -> Event:
        new, self.sent = tuple(self.output[self.sent :]), len(self.output)
        return Event(text, new, len(self.output), finish_reason, error)

    @property
    def cached(self) -> int:
        """Tokens whose keys/values are in the cache: the prompt and all outputs but the last."""
        return len(self.request.prompt_ids) + len(self.output) - 1

    @property
    def tokens(self) -> list[int]:
        return self.request.prompt_ids + self.output


@dataclass(frozen=True)
class Prefill:
    """Prompt tokens start..end of a sequence to compute into `slot` in this step's forward (its
    positions 0..start hold the prompt's keys/values already: a cached prefix, earlier chunks);
    the draft model's cache, which has no prefix cache, gets draft_from..end."""

    sequence: Sequence
    slot: int
    start: int
    end: int
    draft_from: int

    @property
    def last(self) -> bool:
        """Whether this ends the prompt (its first token is sampled after the forward)."""
        return self.end == len(self.sequence.request.prompt_ids)


class Engine:
    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        cache: SlotKVCache,
        *,
        max_running: int = 32,
        max_waiting: int = 256,
        max_prefill_tokens: int = 512,
        chunked_prefill_size: int = 512,
        metrics: ServeMetrics | None = None,
        speculative: SpeculativeConfig | None = None,
        draft: PreTrainedModel | None = None,
        prefix_cache: PrefixCache | None = None,
    ) -> None:
        self.model, self.tokenizer, self.cache = model.eval(), tokenizer, cache
        self.prefix_cache = prefix_cache
        self.max_running, self.max_waiting, self.max_prefill_tokens = max_running, max_waiting, max_prefill_tokens
        if chunked_prefill_size < 0:
            raise ValueError(f"chunked_prefill_size must be >= 0 (0: off); got {chunked_prefill_size}")
        self.chunked_prefill_size = chunked_prefill_size
        self.prefilling: Sequence | None = None  # a prompt partly prefilled, its request at waiting[0]
        self.metrics = metrics or ServeMetrics()
        self.metrics.kv_slots_total.set(cache.num_slots)
        self.context_length = min(model.config.max_position_embeddings, cache.max_len)
        self.eos = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
        self.device = next(model.parameters()).device
        self.waiting: deque[GenerationRequest] = deque()
        self.running: list[Sequence] = []
        self._aborted: set[str] = set()
        self._wakeup = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._grammar_tokenizer: GrammarTokenizer | None = None
        self._grammar_lock = threading.Lock()
        self.speculative = speculative
        self.draft: DraftModel | None = None
        if speculative is not None and speculative.method == "draft":
            if draft is None:
                raise ValueError("speculative method 'draft' needs a draft model")
            if draft.config.vocab_size != model.config.vocab_size:
                raise ValueError(
                    f"the draft model's vocabulary ({draft.config.vocab_size} tokens) differs from the "
                    f"model's ({model.config.vocab_size}): a draft model must share the tokenizer"
                )
            self.draft = DraftModel(draft, cache.num_slots, cache.max_len)

    # --- any thread --------------------------------------------------------------------------

    def check(self, request: GenerationRequest) -> None:
        """Raise RequestRejected if `request` could never run."""
        total = len(request.prompt_ids) + request.max_tokens
        if request.grammar is not None:
            self.check_grammar(request.grammar)
        if not request.prompt_ids:
            raise RequestRejected("the prompt is empty", "prompt")
        if total > self.context_length:
            raise RequestRejected(
                f"this model's maximum context length is {self.context_length} tokens; the request asks for "
                f"{total} ({len(request.prompt_ids)} in the prompt + {request.max_tokens} max_tokens): "
                "shorten the prompt or lower max_tokens",
                "prompt" if len(request.prompt_ids) >= self.context_length else "max_tokens",
            )

    def check_grammar(self, grammar: Grammar) -> None:
        """Raise RequestRejected if `grammar` does not compile for this model's tokenizer."""
        try:
            self.grammar_tokenizer().check(grammar)
        except GrammarError as e:
            raise RequestRejected(str(e), "response_format") from None

    def grammar_tokenizer(self) -> GrammarTokenizer:
        """The tokenizer as the grammar engine sees it, built at the first structured request."""
        with self._grammar_lock:
            if self._grammar_tokenizer is None:
                self._grammar_tokenizer = GrammarTokenizer(self.tokenizer, self.model.config.vocab_size)
            return self._grammar_tokenizer

    def submit(self, request: GenerationRequest) -> None:
        """Queue `request` (checked first); raises RequestRejected or QueueFull."""
        self.check(request)
        with self._wakeup:
            if len(self.waiting) >= self.max_waiting:
                raise QueueFull(f"{len(self.waiting)} requests are waiting already; retry later")
            self.waiting.append(request)
            self.metrics.waiting.set(len(self.waiting))
            self._wakeup.notify()

    def abort(self, request_id: str) -> None:
        """Cancel a request (waiting or running); its slot is freed at the next step."""
        with self._wakeup:
            self._aborted.add(request_id)
            self._wakeup.notify()

    def start(self) -> None:
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="llmstack-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        with self._wakeup:
            self._stopping = True
            self._wakeup.notify()
        if self._thread is not None:
            self._thread.join()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # --- the engine thread -------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self._wakeup:
                while not (self._stopping or self.waiting or self.running or self._aborted):
                    self._wakeup.wait()
                if self._stopping:
                    return
            self.step()

    @torch.inference_mode()
    def step(self) -> None:
        """One scheduler iteration: cancel, admit and plan the prefills, then one forward over the
        prefills' and the running batch's new tokens."""
        self._apply_aborts()
        try:
            if self.chunked_prefill_size:
                prefills = self._schedule_chunks()
            else:
                prefills = [self._whole(sequence) for sequence in self._admit()]
            if prefills or self.running:
                self._forward(prefills)
        except Exception as e:  # a failed forward ends the requests it carried, not the server
            log.exception("engine step failed")
            error = f"{type(e).__name__}: {e}"
            partial, self.prefilling = self.prefilling, None
            if partial is not None:  # a prompt in the middle of its chunks ends too
                with self._wakeup:
                    self.waiting.popleft()
                self.metrics.finished.labels("error").inc()
                partial.request.on_event(partial.event("", "error", error))
            for running in list(self.running):
                self._finish(running, "error", error=error)
        self._update_gauges()

    def _apply_aborts(self) -> None:
        with self._wakeup:
            aborted, self._aborted = self._aborted, set()
            kept = [r for r in self.waiting if r.id not in aborted]
            dropped = [r for r in self.waiting if r.id in aborted]
            self.waiting = deque(kept)
            if self.prefilling is not None and self.prefilling.request.id in aborted:
                self.prefilling = None  # its slot (the last) is simply free again
        for request in dropped:
            self.metrics.finished.labels("abort").inc()
            request.on_event(Event("", (), 0, "abort"))
        for sequence in [s for s in self.running if s.request.id in aborted]:
            self._finish(sequence, "abort")

    def _admit(self) -> list[Sequence]:
        admitted: list[Sequence] = []
        prefill_tokens = 0
        with self._wakeup:
            while self.waiting and len(self.running) < min(self.max_running, self.cache.num_slots):
                prompt_ids = self.waiting[0].prompt_ids
                prefill_tokens += self._uncached(prompt_ids)
                stored = [s.request.prompt_ids for s in admitted]
                if admitted and (prefill_tokens > self.max_prefill_tokens or self._reuses_later(prompt_ids, stored)):
                    break
                sequence = self._new_sequence(self.waiting.popleft())
                self.running.append(sequence)
                admitted.append(sequence)
        self._update_gauges()
        return admitted

    def _new_sequence(self, request: GenerationRequest) -> Sequence:
        seen = torch.zeros(1, self.model.config.vocab_size, dtype=torch.bool, device=self.device)
        seen[0, request.prompt_ids] = True
        generator = None if request.seed is None else torch.Generator(self.device).manual_seed(request.seed)
        matcher = None if request.grammar is None else self.grammar_tokenizer().matcher(request.grammar)
        return Sequence(request, IncrementalText(self.tokenizer, request.stop), seen, generator, matcher)

    def _uncached(self, prompt_ids: list[int]) -> int:
        """The prompt tokens a prefill would compute now (all but the cached prefix)."""
        if self.prefix_cache is None:
            return len(prompt_ids)
        return len(prompt_ids) - min(self.prefix_cache.match(prompt_ids), len(prompt_ids) - 1)

    def _reuses_later(self, prompt_ids: list[int], stored: list[list[int]]) -> bool:
        """Whether the prompt shares more whole blocks with a prompt this step completes (and
        stores in the prefix cache after its forward) than the cache holds for it now: it then
        waits a step and reuses them, as SGLang holds back a prefix shared within a batch."""
        if self.prefix_cache is None:
            return False
        block, limit = self.prefix_cache.block_size, len(prompt_ids) - 1
        cached = min(self.prefix_cache.match(prompt_ids), limit)
        for other in stored:
            shared = next(
                (i for i, (a, b) in enumerate(zip(prompt_ids, other)) if a != b), min(len(prompt_ids), len(other))
            )
            if min(shared, limit, len(other)) // block * block > cached:
                return True
        return False

    def _whole(self, sequence: Sequence) -> Prefill:
        """The prefill of a whole prompt (after its cached prefix) into the sequence's slot."""
        slot = self.running.index(sequence)
        start = self._load_prefix(sequence, slot)
        return Prefill(sequence, slot, start, len(sequence.request.prompt_ids), draft_from=0)

    def _schedule_chunks(self) -> list[Prefill]:
        """At most `chunked_prefill_size` prompt tokens to prefill this step: first the rest of a
        prompt in progress (one chunk of it), then waiting prompts in order; a prompt that does not
        fit whole in what is left of the budget is begun in the last slot and goes on next step."""
        budget, last = self.chunked_prefill_size, self.cache.num_slots - 1
        plan: list[Prefill] = []
        while budget > 0:
            sequence = self.prefilling
            if sequence is None:  # the next waiting prompt: whole into the batch's next slot, or begun
                with self._wakeup:
                    if not self.waiting or len(self.running) >= min(self.max_running, self.cache.num_slots):
                        break
                    request = self.waiting[0]
                    if self._reuses_later(request.prompt_ids, [p.sequence.request.prompt_ids for p in plan if p.last]):
                        break
                    if self._uncached(request.prompt_ids) <= budget:
                        sequence = self._new_sequence(self.waiting.popleft())
                        self.running.append(sequence)
                if sequence is not None:
                    budget -= self._uncached(request.prompt_ids)
                    plan.append(self._whole(sequence))
                    continue
                sequence = self.prefilling = self._new_sequence(request)
                sequence.prefilled = self._load_prefix(sequence, last)
                draft_from = 0
            else:
                draft_from = sequence.prefilled
            prompt_ids, start = sequence.request.prompt_ids, sequence.prefilled
            end = min(len(prompt_ids), start + budget)
            budget -= end - start
            if end < len(prompt_ids):
                plan.append(Prefill(sequence, last, start, end, draft_from))
                sequence.prefilled = end
                continue
            with self._wakeup:  # its last chunk: the sequence joins the batch, in slot n
                self.waiting.popleft()
                self.prefilling = None
                slot = len(self.running)
                self.running.append(sequence)
            if slot != last:
                self.cache.move(last, slot, start)
                if self.draft is not None:
                    self.draft.move(last, slot, draft_from)
            plan.append(Prefill(sequence, slot, start, end, draft_from))
        self._update_gauges()
        return plan

    def _load_prefix(self, sequence: Sequence, slot: int) -> int:
        """With a prefix cache, copy the prompt's longest cached prefix (all but the last token at
        most, whose logits are needed) into `slot`; returns its length (0 without a cache)."""
        if self.prefix_cache is None:
            return 0
        prompt_ids = sequence.request.prompt_ids
        start = self.prefix_cache.load(prompt_ids, self.cache, slot, limit=len(prompt_ids) - 1)
        self.metrics.prefix_query_tokens.inc(len(prompt_ids))
        self.metrics.prefix_hit_tokens.inc(start)
        return start

    def _forward(self, prefills: list[Prefill]) -> None:
        """The step's one forward, over its tokens packed in one row (vLLM's flattened batch): the
        prefills' prompt tokens, then each running row's last token and the speculative
        proposer's guesses after it (none without one; rows padded to the longest guess). Each
        prefill computes its tokens into its slot, and those that end their prompt store its
        blocks in the prefix cache and sample its first token; each running row then emits the
        tokens its verification keeps. The rows are the sequences that have a token already
        (slots 0..n-1; this step's new ones follow them); they are settled last first, so a row
        that ends hands its slot to a sequence already settled (whose cache holds all it has kept)."""
        batch = [s for s in self.running if s.output]
        assert batch == self.running[: len(batch)], "the running rows precede this step's new sequences"
        ids: list[int] = []
        positions: list[int] = []
        views: list[tuple[CacheView, int]] = []
        for p in prefills:
            ids += p.sequence.request.prompt_ids[p.start : p.end]
            positions += range(p.start, p.end)
            views.append((CacheView(self.cache, slot=p.slot, start=p.start), p.end - p.start))
        ends = torch.tensor([p.end - p.start for p in prefills], dtype=torch.long).cumsum(0) - 1
        decode, new = None, 0
        guesses: list[list[int]] = []
        draft_probs: torch.Tensor | None = None
        if batch:
            lengths = torch.tensor([s.cached for s in batch], device=self.device)
            guesses, draft_probs = self._propose(batch, int(lengths.max()))
            new = 1 + max(len(g) for g in guesses)
            decode = CacheView(self.cache, lengths=lengths, new_tokens=new)
            for s, g, length in zip(batch, guesses, lengths.tolist()):
                ids += [s.output[-1], *g] + [0] * (new - 1 - len(g))
                positions += range(length, length + new)
        keep = torch.cat([ends, torch.arange(len(ids) - len(batch) * new, len(ids))]).to(self.device)
        packed = PackedView(views, decode)
        logits = self.model(
            torch.tensor([ids], device=self.device),
            position_ids=torch.tensor([positions], device=self.device),
            cache=packed,
            use_cache=True,
            logits_to_keep=keep,
        ).logits[0]
        packed.commit()
        for p in prefills:  # every cache complete before any slot moves (a sequence that ends)
            self.metrics.prefill_chunks.inc()
            self.metrics.prefill_tokens.inc(p.end - p.start)
            if self.draft is not None:
                self.draft.prefill(p.slot, p.sequence.request.prompt_ids[p.draft_from : p.end], start=p.draft_from)
            if p.last and self.prefix_cache is not None:
                self.prefix_cache.store(p.sequence.request.prompt_ids, self.cache, p.slot)
                self.metrics.prefix_cached_tokens.set(self.prefix_cache.cached_tokens)
        for i, p in enumerate(prefills):
            if p.last:
                self._accept(p.sequence, self._sample(p.sequence, logits[i : i + 1]))
        logits = logits[len(prefills) :].unflatten(0, (len(batch), new)) if batch else logits
        for row in reversed(range(len(batch))):
            sequence, guess = batch[row], guesses[row]
            if not guess:
                emitted = [self._sample(sequence, logits[row, :1])]
            else:
                emitted = self._verify(sequence, logits[row, : len(guess) + 1], guess, draft_probs, row)
                self.metrics.draft_tokens.inc(len(guess))
                self.metrics.accepted_tokens.inc(len(emitted) - 1)
            for token in emitted:
                if not self._accept(sequence, token):
                    break

    def _propose(self, batch: list[Sequence], longest: int) -> tuple[list[list[int]], torch.Tensor | None]:
        """Each row's speculative guesses (at most what it may still emit, and within the cache)
        and, from a sampling draft model, the distributions they were drawn from."""
        spec = self.speculative
        if spec is None:
            return [[] for _ in batch], None
        k = min(spec.num_tokens, self.cache.max_len - longest - 1)
        room = [0 if s.matcher is not None else max(min(k, s.request.max_tokens - len(s.output) - 1), 0) for s in batch]
        if max(room) == 0:
            return [[] for _ in batch], None
        if self.draft is None:
            return [ngram_proposal(s.tokens, r, spec.ngram_max, spec.ngram_min) for s, r in zip(batch, room)], None
        inputs = [DraftInput(s.tokens, s.request.sampling, s.seen, s.generator) for s in batch]
        guesses, probs = self.draft.propose(inputs, max(room))
        return [g[:r] for g, r in zip(guesses, room)], probs

    def _verify(
        self, sequence: Sequence, logits: torch.Tensor, guess: list[int], draft_probs: torch.Tensor | None, row: int
    ) -> list[int]:
        """The tokens the acceptance rule keeps of `guess`, then one more; `logits` (len(guess) + 1,
        vocab) are the model's after each prefix of the guess."""
        sampling = sequence.request.sampling
        if sampling.repetition_penalty == 1.0:
            target = probabilities(logits, sampling, sequence.seen)
        else:  # each position's penalty counts the guesses before it
            seen, rows = sequence.seen.clone(), []
            for j in range(len(guess) + 1):
                rows.append(probabilities(logits[j : j + 1], sampling, seen))
                if j < len(guess):
                    seen[0, guess[j]] = True
            target = torch.cat(rows)
        if sampling.greedy:
            return accept_greedy(target.argmax(dim=-1).tolist(), guess)
        q = None if draft_probs is None else draft_probs[row, : len(guess)]
        return accept_sampled(target, guess, q, sequence.generator)

    def _sample(self, sequence: Sequence, logits: torch.Tensor) -> int:
        if sequence.matcher is not None:
            logits = sequence.matcher.mask(logits)
        return int(next_token(logits, sequence.request.sampling, sequence.seen, sequence.generator))

    def _accept(self, sequence: Sequence, token: int) -> bool:
        """Record a sampled token and tell the client; retire the sequence if it is done. Says
        whether the sequence goes on."""
        now = time.monotonic()
        request = sequence.request
        if sequence.last_token_time is None:
            self.metrics.ttft.observe(now - request.arrival)
        else:
            self.metrics.itl.observe(now - sequence.last_token_time)
        sequence.last_token_time = now
        self.metrics.count_tokens(1)
        if sequence.matcher is not None:
            sequence.matcher.consume(token)
        if token in self.eos and (not request.ignore_eos or sequence.matcher is not None):
            self._finish(sequence, "stop")
            return False
        sequence.output.append(token)
        sequence.seen[0, token] = True
        text = sequence.text.push([token])
        if sequence.text.stopped or (sequence.matcher is not None and sequence.matcher.done):
            self._finish(sequence, "stop", text)
        elif len(sequence.output) >= request.max_tokens:
            self._finish(sequence, "length", text)
        else:
            if text:
                request.on_event(sequence.event(text))
            return True
        return False

    def _finish(self, sequence: Sequence, reason: str, text: str = "", error: str | None = None) -> None:
        slot, last = self.running.index(sequence), self.running[-1]
        if last is not sequence:  # the last sequence takes the freed slot: slots stay 0..n-1
            length = min(last.cached + 1, self.cache.max_len)
            self.cache.move(len(self.running) - 1, slot, length)
            if self.draft is not None:
                self.draft.move(len(self.running) - 1, slot, length)
            self.running[slot] = last
        self.running.pop()
        self.metrics.finished.labels(reason).inc()
        sequence.request.on_event(sequence.event(text + sequence.text.finish(), reason, error))

    def _update_gauges(self) -> None:
        self.metrics.waiting.set(len(self.waiting))
        self.metrics.running.set(len(self.running))
        self.metrics.kv_slots_used.set(len(self.running) + (self.prefilling is not None))
