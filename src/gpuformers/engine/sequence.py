"""One request's state in the continuous batching engine: its tokens, its blocks and its sampling parameters.

The scheduler and the block manager move only integers and lists held here, never tensors. A sequence's tokens
are `prompt_ids + generated_ids`; `num_computed_tokens` of them already have their keys and values in the paged
cache. Each step computes the next `chunk` uncomputed tokens; when a chunk reaches the last token, the step samples
one new token from its logits (so a decode step is simply a chunk of one token).

    prompt_ids            generated_ids
    [p0 p1 p2 p3 p4 p5 p6][g0 g1]
    |<---- computed ------------>|   <- decode: the last token g1 is the one uncomputed token

With asynchronous batching a step is scheduled before the previous one's tokens reach the host: a sequence that
samples in step N gets a placeholder (`PLACEHOLDER`, counted by `num_pending_tokens`) at the end of `token_ids`
when step N is launched, step N+1 feeds it from the device, and `fill_placeholder` writes the real token over it
when step N is collected. `generated_ids` only ever holds real tokens.

    [p0 p1 p2 p3 p4 p5 p6][g0 g1][?]    <- g1 computed by step N+1 (in flight), ? sampled by step N+1

When a request is finished (eos, a stop sequence, its length) is decided by generation/stop_rules.py's StopRules,
the rules generate()'s stopping criteria follow too; `Sequence.finish_reason` records which one ended it.

Offers: RequestStatus, SamplingParams, Sequence, PLACEHOLDER.
"""

from __future__ import annotations

import enum
import itertools
import math
import operator
from dataclasses import dataclass, field
from typing import Any

from gpuformers.generation.stop_rules import FinishReason, StopRules, reached_length


class RequestStatus(str, enum.Enum):
    """Where a request is in its life (the names transformers' GenerationOutput uses)."""

    PENDING = "pending"  # waiting for admission (also after a preemption)
    PREFILLING = "prefilling"  # admitted, prompt (or recomputed prefix) not fully in the cache yet
    DECODING = "decoding"  # producing one token per step
    FINISHED = "finished"
    FAILED = "failed"


# The statuses of a request that has ended, in a constant: asked of every request several times per engine step, and
# naming the members in the test (an Enum class attribute each) cost four times the test itself.
ENDED = (RequestStatus.FINISHED, RequestStatus.FAILED)
_DECODING = RequestStatus.DECODING  # (set after every token: a global, not an Enum class attribute)


@dataclass
class SamplingParams:
    """Per-request sampling settings. temperature 0 or do_sample=False is greedy decoding.

    stop: token ids (ints) or token-id sequences (lists) that end generation when the output ends with them.
    Logit adjustments, applied to greedy and sampled requests alike (sampler.py gives the order):
        logit_bias: {token_id: bias} added to the logits (OpenAI's; a token id past the LM head is ignored).
        repetition_penalty: transformers' rule over prompt and output tokens: a seen token's logit is divided by
            it when positive, multiplied when negative (1.0 is off).
        frequency_penalty, presence_penalty: OpenAI's rule over the output tokens only, in [-2, 2]:
            logit -= frequency_penalty * count + presence_penalty * (count > 0).
        min_new_tokens: eos (unless ignore_eos) and the one-token stops are masked until that many tokens exist,
            and no longer stop sequence ends the request before then.
    min_p: sampled requests keep the tokens whose probability is at least min_p times the top one's (transformers'
        MinPLogitsWarper, after top-k and top-p; 0 is off).
    seed: a per-request generator seed, so a sampled request gives the same tokens whatever it is batched with.
    prompt_logprobs: None (off), or k in [0, 20]: the logprob of every prompt token given the tokens before it
        (the first token has none: None), plus its k most likely alternatives, from the model's raw logits (no
        temperature, top-k or top-p). Such a request takes no prefix-cache hits until its prompt logprobs are all
        computed: a block taken from the cache has keys and values but no logits.
    structured_output: a structured.Grammar (StructuredOutputCompiler.compile): only tokens the grammar allows are
        sampled, and the request ends when the grammar is complete (structured.py).
    """

    max_new_tokens: int = 20
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    eos_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    stop: list[int | list[int]] = field(default_factory=list)
    seed: int | None = None
    return_logprobs: bool = False
    top_logprobs: int = 0  # with return_logprobs: also the k most likely tokens at each step (at most 20)
    prompt_logprobs: int | None = None
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    min_new_tokens: int = 0
    logit_bias: dict[int, float] = field(default_factory=dict)
    structured_output: Any = None

    def __post_init__(self):
        # Each value is checked here, for its own request: one that fails inside a step (a NaN temperature, a float
        # top_k or seed) would fail every request of that step.
        if _as_int(self.max_new_tokens) is None or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens!r} must be an int >= 1")
        if not _is_number(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature={self.temperature!r} must be a number >= 0 (0 means greedy)")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p!r} must be a number in (0, 1]")
        if _as_int(self.top_k) is None or self.top_k < 0:
            raise ValueError(f"top_k={self.top_k!r} must be an int >= 0 (0 turns it off)")
        if self.seed is not None and _as_int(self.seed) is None:
            raise ValueError(f"seed={self.seed!r} must be an int (or None: no per-request generator)")
        self.max_new_tokens, self.top_k = int(self.max_new_tokens), int(self.top_k)
        self.seed = None if self.seed is None else int(self.seed)
        stops = [self.stop] if _as_int(self.stop) is not None else self.stop
        if not isinstance(stops, (list, tuple)):
            raise ValueError(f"stop={self.stop!r} must be a list of token ids and token-id sequences (text stops: "
                             f"tokenize them; the server's stop= matches text)")
        self.stop = [_stop_sequence(s) for s in stops]
        if not isinstance(self.top_logprobs, int) or not 0 <= self.top_logprobs <= 20:
            raise ValueError(f"top_logprobs={self.top_logprobs!r} must be an int in [0, 20]")
        if self.prompt_logprobs is not None and (isinstance(self.prompt_logprobs, bool)
                                                 or not isinstance(self.prompt_logprobs, int)
                                                 or not 0 <= self.prompt_logprobs <= 20):
            raise ValueError(f"prompt_logprobs={self.prompt_logprobs!r} must be None (off) or an int in [0, 20]")
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p={self.min_p!r} must be a number in [0, 1] (0 turns it off)")
        if not _is_number(self.repetition_penalty) or not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty={self.repetition_penalty!r} must be a number > 0 (1.0 turns it "
                             f"off; above 1 discourages repeats)")
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2 <= value <= 2:
                raise ValueError(f"{name}={value!r} must be a number in [-2, 2] (0 turns it off)")
        if not isinstance(self.min_new_tokens, int) or isinstance(self.min_new_tokens, bool) or self.min_new_tokens < 0:
            raise ValueError(f"min_new_tokens={self.min_new_tokens!r} must be an int >= 0")
        if not isinstance(self.logit_bias, dict):
            raise ValueError(f"logit_bias={self.logit_bias!r} must be a dict {{token_id: bias}}")
        for token, bias in self.logit_bias.items():
            if isinstance(token, bool) or not isinstance(token, int) or token < 0:
                raise ValueError(f"logit_bias key {token!r} must be a token id (an int >= 0)")
            if not _is_number(bias):
                raise ValueError(f"logit_bias[{token}]={bias!r} must be a finite number")
        if self.structured_output is not None and self.min_new_tokens:
            raise ValueError(f"min_new_tokens={self.min_new_tokens} with structured_output: the grammar decides where "
                             f"the output ends (masking eos before then could leave no token allowed); leave it 0")
        if self.top_logprobs:
            self.return_logprobs = True
        self.eos_token_ids = tuple(int(t) for t in self.eos_token_ids)
        self.logit_bias = {token: float(bias) for token, bias in self.logit_bias.items()}
        # what ends the request (generation/stop_rules.py), from the settings just checked
        self.stop_rules = StopRules(self.max_new_tokens, () if self.ignore_eos else self.eos_token_ids, self.stop,
                                    self.min_new_tokens)

    @property
    def greedy(self) -> bool:
        return not self.do_sample or self.temperature == 0

    @property
    def uses_penalties(self) -> bool:
        """Whether sampling needs the request's token counts (sampler.TokenCounts)."""
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    @property
    def ending_tokens(self) -> list[int]:
        """The tokens min_new_tokens masks: those that end the request on their own (StopRules.ending_tokens)."""
        return list(self.stop_rules.ending_tokens)

    def adjusts_logits(self, num_generated: int) -> bool:
        """Whether the logits of this request's next token (after `num_generated` tokens) need any adjustment
        before the greedy choice or the sampling warpers."""
        return self.uses_penalties or bool(self.logit_bias) or self.stop_rules.suppresses_endings(num_generated)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _as_int(value) -> int | None:
    """value as an int when it is an integer (Python, numpy or a 0-d tensor's; not a bool), else None."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def _stop_sequence(stop) -> list[int]:
    """One entry of SamplingParams.stop (a token id or a sequence of them) -> a list of token ids."""
    tokens = [_as_int(t) for t in stop] if isinstance(stop, (list, tuple)) else [_as_int(stop)]
    if not tokens or None in tokens:
        raise ValueError(f"stop entry {stop!r} must be a token id or a non-empty list of token ids")
    return tokens


_arrivals = itertools.count()

# A token sampled on the device whose value the host does not know yet. Negative, so that a placeholder that reached
# an embedding by mistake fails loudly instead of reading a real token's row.
PLACEHOLDER = -1


class Sequence:
    """A request: prompt, generated tokens, paged-cache blocks and progress counters."""

    def __init__(self, request_id: str, prompt_ids: list[int], params: SamplingParams, streaming: bool = False,
                 adapter_name: str | None = None):
        if not prompt_ids:
            raise ValueError(f"request {request_id!r} has an empty prompt; give at least one token id")
        self.request_id = request_id
        self.prompt_ids = [int(t) for t in prompt_ids]
        self._output_prompt_ids: list[int] | None = None  # (output_prompt_ids)
        self.shares_output_lists = False  # its outputs hold its own lists (manager.add_request's share_lists)
        self.generated_ids: list[int] = []
        self.logprobs: list[float] = []
        self.top_logprobs: list[list[tuple[int, float]]] = []  # per generated token, when params.top_logprobs
        # Per prompt token, its logprob given the tokens before it (None for the first) and, when
        # params.prompt_logprobs > 0, its top alternatives; the model runner fills them chunk by chunk.
        wants, top = params.prompt_logprobs is not None, bool(params.prompt_logprobs)
        self.prompt_logprobs: list[float | None] = [None] if wants else []
        self.prompt_top_logprobs: list[list[tuple[int, float]] | None] = [None] if top else []
        self.params = params
        self.streaming = streaming
        self.adapter_name = adapter_name  # the LoRA adapter the request runs with (lora.py); None: the base model
        # The adapter's load number (AdapterBank): the chain start of the prefix-cache hashes, so blocks computed
        # under one adapter (or an earlier load of the same name) never serve another.
        self.adapter_id: int | None = None
        self.status = RequestStatus.PENDING
        self.error: str | None = None
        self.arrival = next(_arrivals)  # the order of arrival: preemption takes the newest first
        self.block_table: list[int] = []  # physical block ids, one per block_size tokens
        self.block_hashes: list[int] = []  # prefix hash of each full, computed block (prefix sharing)
        self.num_computed_tokens = 0
        self.num_pending_tokens = 0  # placeholders at the end of token_ids (sampled in a step not collected yet)
        self.num_cached_tokens = 0  # tokens found in the prefix cache instead of computed (over all admissions)
        self.num_preemptions = 0
        # A model with mamba layers (state_slots.py): the sequence's state slot, a prefix snapshot's slot to restore
        # into it before its next step, and (tokens, block hash) where its state is to be kept as a snapshot
        self.state_row: int | None = None
        self.state_restore: int | None = None
        self.snapshot_at: tuple[int, int] | None = None
        self.generator = None  # a torch.Generator made by the model runner when params.seed is set
        # with params.structured_output: an xgrammar GrammarMatcher that has seen every generated token
        grammar = params.structured_output
        self.grammar_matcher = grammar.matcher() if grammar is not None else None
        self.finish_reason: FinishReason | None = None  # the stop rule that ended it (None: running, failed)
        self.created_time = 0.0

    # --- derived values -----------------------------------------------------------------------------------------

    @property
    def output_prompt_ids(self) -> list[int]:
        """The prompt as the request's outputs carry it: one copy, made for the first output and shared by all of
        them, apart from the engine's own list (a caller that changes an output's prompt changes nothing the engine
        reads). A copy per output cost ~10 us per streaming request and step for a 4k-token prompt: at 256 streams
        of 2k-6k-token prompts, 7.8 of a step's 11.6 ms of host work (bench_engine_host.py --streaming)."""
        if self._output_prompt_ids is None:
            self._output_prompt_ids = list(self.prompt_ids)
        return self._output_prompt_ids

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.generated_ids + [PLACEHOLDER] * self.num_pending_tokens

    def tokens(self, start: int, stop: int) -> list[int]:
        """token_ids[start:stop] (0 <= start), without building the whole list: the engine reads a step's few new
        tokens of sequences that may be thousands long."""
        prompt, generated = len(self.prompt_ids), len(self.generated_ids)
        stop = min(stop, prompt + generated + self.num_pending_tokens)
        if start >= stop:
            return []
        found = self.prompt_ids[start:stop] if start < prompt else []
        if stop > prompt:
            found += self.generated_ids[max(start - prompt, 0):stop - prompt]
        if stop > prompt + generated:
            found += [PLACEHOLDER] * (stop - max(start, prompt + generated))
        return found

    def token_at(self, position: int) -> int:
        """token_ids[position] (0 <= position < num_tokens): a decode's one input token, without a list."""
        prompt = self.prompt_ids
        if position < len(prompt):
            return prompt[position]
        position -= len(prompt)
        return self.generated_ids[position] if position < len(self.generated_ids) else PLACEHOLDER

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.generated_ids) + self.num_pending_tokens

    @property
    def num_output_tokens(self) -> int:
        """Tokens sampled so far, counting those still in flight (known without waiting for their values)."""
        return len(self.generated_ids) + self.num_pending_tokens

    @property
    def out_of_new_tokens(self) -> bool:
        """Whether the sampled tokens, counting those still in flight, reach max_new_tokens: such a sequence is
        never scheduled again."""
        return reached_length(self.num_output_tokens, self.params.max_new_tokens)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def max_tokens(self) -> int:
        """Tokens whose keys and values the cache must hold at most: the last generated token is never fed back."""
        return len(self.prompt_ids) + self.params.max_new_tokens - 1

    @property
    def is_finished(self) -> bool:
        return self.status in ENDED

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Whether the request asked for prompt logprobs and some prompt tokens still lack theirs."""
        return self.params.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt_ids)

    def prompt_logprob_positions(self, start: int, num_tokens: int) -> range:
        """Positions among [start, start + num_tokens) (one step's chunk) whose logits give a prompt token's
        logprob not recorded yet: position q gives token q + 1's. Empty for requests that did not ask, and for the
        part of a chunk recomputed after a preemption (its logprobs were recorded the first time)."""
        if not self.wants_prompt_logprobs:
            return range(0)
        return range(max(start, len(self.prompt_logprobs) - 1), min(start + num_tokens, len(self.prompt_ids) - 1))

    def __repr__(self) -> str:
        return (f"Sequence({self.request_id!r}, {self.status.value}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, blocks={self.block_table})")

    # --- updates ------------------------------------------------------------------------------------------------

    def append_token(self, token_id: int, logprob: float | None = None,
                     top: list[tuple[int, float]] | None = None) -> None:
        """Add a sampled token (with its logprob and the top alternatives when asked for) and decide whether the
        request is done (eos, a stop sequence or the length: params.stop_rules; or its grammar is complete)."""
        self.generated_ids.append(int(token_id))
        if logprob is not None:
            self.logprobs.append(float(logprob))
        if top is not None:
            self.top_logprobs.append(top)
        reason = self.params.stop_rules.finish_reason(self.generated_ids)
        if self.grammar_matcher is not None and reason is None:
            if not self.grammar_matcher.accept_token(token_id):  # a token the mask allowed is never refused
                self.fail(f"token {token_id} does not fit {self.params.structured_output.name} (structured output)")
                self.num_pending_tokens = 0
                return
            if self.grammar_matcher.is_terminated():
                reason = FinishReason.GRAMMAR
        if reason is not None:
            self.finish_reason = reason
            self.status = RequestStatus.FINISHED
            self.num_pending_tokens = 0  # a token sampled after the end (async lookahead) is dropped
        else:
            self.status = _DECODING

    def add_placeholder(self) -> None:
        """A step that samples this sequence was launched; its token is known on the device only."""
        self.num_pending_tokens += 1

    def fill_placeholder(self, token_id: int, logprob: float | None = None,
                         top: list[tuple[int, float]] | None = None) -> None:
        """The oldest placeholder's real token arrived: append it as append_token does (stop rules included)."""
        if not self.num_pending_tokens:
            raise RuntimeError(f"request {self.request_id!r}: a sampled token arrived but none was pending")
        self.num_pending_tokens -= 1
        self.append_token(token_id, logprob, top)

    def add_prompt_logprobs(self, first: int, logprobs: list[float],
                            top: list[list[tuple[int, float]]] | None = None) -> None:
        """Record the logprobs of prompt tokens first, first + 1, ... (and their top alternatives when asked for)."""
        if first != len(self.prompt_logprobs):
            raise RuntimeError(f"request {self.request_id!r}: prompt logprobs from token {first} but "
                               f"{len(self.prompt_logprobs)} are recorded; a prefill chunk was skipped")
        self.prompt_logprobs.extend(float(v) for v in logprobs)
        if top is not None:
            self.prompt_top_logprobs.extend(top)

    def fail(self, message: str) -> None:
        self.status = RequestStatus.FAILED
        self.error = message
