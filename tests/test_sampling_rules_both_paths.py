"""One suite for the rules generate() and the engine share, run through both: the allowed-token mask
(generate(prefix_allowed_tokens_fn=) and the engine's structured-output grammar, both sampling_ops.mask_to_allowed),
the min-tokens suppression of the tokens that end a sequence (sampling_ops.suppress_before_min_tokens), and each stop
rule of generation/stop_rules.py: eos, a stop token sequence, a stop string, max_new_tokens.

End to end, on a tiny random Llama with a 300-token byte-level BPE: each case gives the same greedy tokens through
generate(), through the engine (several requests with their own settings in one batch, and the finish reason its
StopRules record) and, where transformers has the behaviour, through transformers' generate on the same weights;
and each rule is shown to matter (its tokens differ from the unconstrained ones, which end at max_new_tokens).
Then the shared functions on the same scores and tokens through both paths' callers and transformers' processors.

transformers is imported inside fixtures and tests (it costs seconds).
"""

from __future__ import annotations

import pytest
import torch

from gpuformers.engine import sampler
from gpuformers.engine.sequence import RequestStatus, SamplingParams, Sequence
from gpuformers.generation import sampling_ops
from gpuformers.generation.constraints import MinLengthLogitsProcessor, MinNewTokensLengthLogitsProcessor
from gpuformers.generation.prefix_constrained import PrefixConstrainedLogitsProcessor
from gpuformers.generation.stop_rules import FinishReason, StopRules
from gpuformers.generation.stopping import EosTokenCriteria, MaxLengthCriteria, StoppingCriteriaList, token_bytes
from tests.test_generate import _pair
from tests.test_stopping import tiny_byte_level_tokenizer

VOCAB = 300
NEW = 16  # new tokens without a stop rule
EOS_TOKEN = 0  # the tokenizer's "<eos>": the grammar's stop token
PROMPT_LENGTHS = [3, 7, 12, 20]


@pytest.fixture(scope="module")
def setup():
    """(transformers model, our model, tokenizer, prompts, refs): refs[i] is prompt i's NEW greedy tokens without any
    stop rule (neither model has an eos of its own here: each case names its own)."""
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tiny_byte_level_tokenizer(), eos_token="<eos>")
    assert tokenizer.eos_token_id == EOS_TOKEN and len(tokenizer.get_vocab()) == VOCAB
    from gpuformers.generation.config import GenerationConfig

    hf, ours = _pair("llama", vocab_size=VOCAB)
    hf.generation_config.eos_token_id = None
    ours.generation_config = GenerationConfig.from_model_config(ours.config)
    ours.generation_config.eos_token_id = None
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]
    refs = [generate(ours, p, max_new_tokens=NEW) for p in prompts]
    assert all(len(r) == NEW for r in refs)
    assert refs == [generate(hf, p, max_new_tokens=NEW) for p in prompts]
    return hf, ours, tokenizer, prompts, refs


def generate(model, prompt: list[int], **settings) -> list[int]:
    """The new tokens of greedy generate() (ours or transformers') for one prompt."""
    out = model.generate(torch.tensor([prompt]), do_sample=False, pad_token_id=0, **settings)
    return out[0, len(prompt):].tolist()


def engine(model, prompts: list[list[int]], requests: list[dict], **generation) -> list[tuple[list[int], str]]:
    """Every prompt as one request of one engine run (prompt i with the settings requests[i], `generation` for all):
    [(its new tokens, the finish reason its stop rules recorded)]."""
    manager = model.init_continuous_batching(block_size=8, num_blocks=64, **generation)
    reasons = {}
    publish = manager._publish_one

    def record(seq, final):
        if final:
            reasons[seq.request_id] = seq.finish_reason
        publish(seq, final)

    manager._publish_one = record
    ids = [manager.add_request(p, **r) for p, r in zip(prompts, requests)]
    manager.run_until_done()
    outputs = [manager.get_result(i, timeout=0) for i in ids]
    assert all(o.status is RequestStatus.FINISHED for o in outputs), [o.error for o in outputs]
    return [(o.generated_tokens, reasons[i]) for o, i in zip(outputs, ids)]


def first_new_of_its_kind(ref: list[int], start: int = 3) -> int:
    """The first position k >= start whose token does not occur before it (nor is the "<eos>" token): an eos there
    ends the sequence at k + 1 tokens exactly."""
    return next(k for k in range(start, len(ref)) if ref[k] not in ref[:k] and ref[k] != EOS_TOKEN)


# ------------------------------------------------------------------------------------------------ end to end


def test_max_new_tokens(setup):
    hf, ours, _, prompts, refs = setup
    limits = [1, 5, NEW, 9]
    expected = [ref[:m] for ref, m in zip(refs, limits)]
    got = engine(ours, prompts, [dict(max_new_tokens=m) for m in limits])
    assert got == [(e, FinishReason.LENGTH) for e in expected]
    for prompt, m, want in zip(prompts, limits, expected):
        assert generate(ours, prompt, max_new_tokens=m) == want == generate(hf, prompt, max_new_tokens=m)


@pytest.mark.parametrize("as_list", [False, True], ids=["one_eos", "eos_list"])
def test_eos(setup, as_list):
    hf, ours, _, prompts, refs = setup
    cut = [first_new_of_its_kind(ref) for ref in refs]
    never = next(t for t in range(1, VOCAB) if not any(t in ref for ref in refs))
    eos = [[never, ref[k]] if as_list else ref[k] for ref, k in zip(refs, cut)]
    expected = [ref[:k + 1] for ref, k in zip(refs, cut)]
    assert all(len(e) < NEW for e in expected)  # the rule matters
    as_ids = [tuple(e) if as_list else (e,) for e in eos]
    got = engine(ours, prompts, [dict(max_new_tokens=NEW, eos_token_ids=e) for e in as_ids])
    assert got == [(e, FinishReason.EOS) for e in expected]
    for prompt, e, want in zip(prompts, eos, expected):
        settings = dict(max_new_tokens=NEW, eos_token_id=e)
        assert generate(ours, prompt, **settings) == want == generate(hf, prompt, **settings)


def test_min_new_tokens_holds_back_eos(setup):
    hf, ours, _, prompts, refs = setup
    cut = [first_new_of_its_kind(ref) for ref in refs]
    eos = [ref[k] for ref, k in zip(refs, cut)]
    minimum = [k + 2 for k in cut]
    expected = []
    for prompt, e, m, ref, k in zip(prompts, eos, minimum, refs, cut):
        settings = dict(max_new_tokens=NEW, eos_token_id=e, min_new_tokens=m)
        want = generate(ours, prompt, **settings)
        assert want == generate(hf, prompt, **settings)
        assert want[:k] == ref[:k] and want[k] != ref[k] and len(want) >= m  # the mask changed the greedy token
        expected.append(want)
    got = engine(ours, prompts, [dict(max_new_tokens=NEW, eos_token_ids=(e,), min_new_tokens=m)
                                 for e, m in zip(eos, minimum)])
    assert [tokens for tokens, _ in got] == expected
    assert [reason for _, reason in got] == [FinishReason.EOS if t[-1] == e else FinishReason.LENGTH
                                             for t, e in zip(expected, eos)]


def test_min_length_of_the_generation_config_holds_back_eos(setup):
    """min_length counts the prompt: generate() and transformers take it as it is, the engine as min_new_tokens."""
    hf, ours, _, prompts, refs = setup
    prompt, ref = prompts[1], refs[1]
    k = first_new_of_its_kind(ref)
    settings = dict(max_new_tokens=NEW, eos_token_id=ref[k], min_length=len(prompt) + k + 2)
    want = generate(ours, prompt, **settings)
    assert want == generate(hf, prompt, **settings)
    assert want[:k] == ref[:k] and want[k] != ref[k]
    [(tokens, _)] = engine(ours, [prompt], [{}], **settings)
    assert tokens == want


def test_min_new_tokens_holds_back_a_one_token_stop_as_eos(setup):
    """A one-token stop sequence ends a request as an eos token does, and min_new_tokens holds it back the same way."""
    _, ours, _, prompts, refs = setup
    cut = [first_new_of_its_kind(ref) for ref in refs]
    stops, minimum = [ref[k] for ref, k in zip(refs, cut)], [k + 2 for k in cut]
    expected = [generate(ours, p, max_new_tokens=NEW, eos_token_id=s, min_new_tokens=m)
                for p, s, m in zip(prompts, stops, minimum)]
    assert all(e[k] != ref[k] for e, ref, k in zip(expected, refs, cut))
    got = engine(ours, prompts, [dict(max_new_tokens=NEW, stop=[[s]], min_new_tokens=m)
                                 for s, m in zip(stops, minimum)])
    assert [tokens for tokens, _ in got] == expected
    assert [reason for _, reason in got] == [FinishReason.STOP_SEQUENCE if t[-1] == s else FinishReason.LENGTH
                                             for t, s in zip(expected, stops)]


def _text_bytes(tokenizer, tokens: list[int]) -> tuple[bytes, list[int]]:
    """The bytes the tokens stand for, and where each token's bytes end."""
    flat, offsets = token_bytes(tokenizer)
    pieces = [bytes(flat[offsets[t]:offsets[t + 1]].tolist()) for t in tokens]
    ends, total = [], 0
    for piece in pieces:
        total += len(piece)
        ends.append(total)
    return b"".join(pieces), ends


def _stop_string_end(tokenizer, prompt: list[int], new: list[int], stop: bytes) -> int | None:
    """How many new tokens generate() keeps with this stop string: up to the first one inside which an occurrence
    of it ends (transformers' StopStringCriteria), the prompt's bytes before them included."""
    text, ends = _text_bytes(tokenizer, prompt + new)
    for n in range(len(new)):
        token = len(prompt) + n
        start = ends[token - 1] if token else 0
        if any(text[end - len(stop):end] == stop for end in range(max(start + 1, len(stop)), ends[token] + 1)):
            return n + 1
    return None


def test_a_stop_token_sequence_and_its_stop_string(setup):
    """The engine's stop token sequence [a, b] ends a request where generate()'s and transformers' stop string
    decode([a, b]) end it, for prompts where the text has no earlier occurrence of that string."""
    hf, ours, tokenizer, prompts, refs = setup
    cases = []
    for prompt, ref in zip(prompts, refs):
        for k in range(2, NEW - 1):
            pair = ref[k - 1:k + 1]
            if EOS_TOKEN in pair or any(ref[j:j + 2] == pair for j in range(k - 1)):
                continue
            stop, _ = _text_bytes(tokenizer, pair)
            try:
                text = stop.decode("utf-8")
            except UnicodeDecodeError:
                continue
            if _stop_string_end(tokenizer, prompt, ref, stop) == k + 1:
                cases.append((prompt, pair, text, ref[:k + 1]))
                break
    assert len(cases) >= 2, "too few prompts whose greedy text suits a stop string"
    got = engine(ours, [c[0] for c in cases], [dict(max_new_tokens=NEW, stop=[c[1]]) for c in cases])
    assert got == [(c[3], FinishReason.STOP_SEQUENCE) for c in cases]
    for prompt, _, text, want in cases:
        settings = dict(max_new_tokens=NEW, stop_strings=text, tokenizer=tokenizer)
        assert generate(ours, prompt, **settings) == want == generate(hf, prompt, **settings)


def test_a_stop_token_sequence_waits_for_min_new_tokens(setup):
    """Before min_new_tokens a stop sequence of two tokens ends nothing (and masks nothing): the engine's tokens are
    generate()'s, cut at the sequence's first occurrence from min_new_tokens on."""
    _, ours, _, prompts, refs = setup
    requests, expected = [], []
    for ref in refs:
        k = first_new_of_its_kind(ref, start=1)
        pair, minimum = ref[k - 1:k + 1], k + 2
        ends = [n for n in range(minimum, NEW + 1) if ref[n - 2:n] == pair]
        requests.append(dict(max_new_tokens=NEW, stop=[pair], min_new_tokens=minimum))
        expected.append((ref[:ends[0]], FinishReason.STOP_SEQUENCE) if ends else (ref, FinishReason.LENGTH))
    got = engine(ours, prompts, requests)
    assert got == expected
    assert [tokens for tokens, _ in engine(ours, prompts, [dict(r, min_new_tokens=0) for r in requests])] != \
        [tokens for tokens, _ in got]  # without min_new_tokens the sequence ends them earlier


def lowercase_tokens(tokenizer) -> list[int]:
    """The tokens whose text is lowercase letters only: what the grammar "[a-z]*" allows besides its stop token."""
    flat, offsets = token_bytes(tokenizer)
    return [t for t in range(VOCAB) if offsets[t + 1] > offsets[t]
            and all(97 <= b <= 122 for b in flat[offsets[t]:offsets[t + 1]].tolist())]


@pytest.fixture(scope="module")
def compiler(setup):
    pytest.importorskip("xgrammar")
    from gpuformers.engine.structured import StructuredOutputCompiler

    _, _, tokenizer, _, _ = setup
    return StructuredOutputCompiler(tokenizer, VOCAB, [EOS_TOKEN])


def test_allowed_tokens_prefix_function_and_grammar(setup, compiler):
    """generate(prefix_allowed_tokens_fn=) allowing the tokens of "[a-z]*" (and eos) gives the tokens the engine
    gives under that regex as its structured output, and transformers' generate with the same function."""
    hf, ours, tokenizer, prompts, refs = setup
    allowed = lowercase_tokens(tokenizer) + [EOS_TOKEN]
    assert 10 < len(allowed) < VOCAB // 2

    def allowed_tokens(batch_id, input_ids):
        return allowed

    settings = dict(max_new_tokens=NEW, eos_token_id=EOS_TOKEN, prefix_allowed_tokens_fn=allowed_tokens)
    expected = [generate(ours, p, **settings) for p in prompts]
    assert expected == [generate(hf, p, **settings) for p in prompts]
    assert all(t in allowed for tokens in expected for t in tokens)
    assert all(e != ref[:len(e)] for e, ref in zip(expected, refs))  # the mask changed the greedy tokens
    grammar = compiler.compile({"type": "regex", "regex": "[a-z]*"})
    got = engine(ours, prompts, [dict(max_new_tokens=NEW, structured_output=grammar)] * len(prompts),
                 eos_token_id=EOS_TOKEN)
    assert [tokens for tokens, _ in got] == expected
    assert [reason for _, reason in got] == [FinishReason.EOS if t[-1] == EOS_TOKEN else FinishReason.LENGTH
                                             for t in expected]


# ----------------------------------------------------------------------------------- the shared functions


def test_the_grammar_mask_and_the_prefix_processor_mask_alike(setup, compiler):
    from transformers.generation.logits_process import PrefixConstrainedLogitsProcessor as HFProcessor

    from gpuformers.engine.structured import mask_logits

    _, _, tokenizer, _, _ = setup
    allowed = lowercase_tokens(tokenizer) + [EOS_TOKEN]
    grammar = compiler.compile({"type": "regex", "regex": "[a-z]*"})
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, VOCAB, generator=g) * 3
    rows = [0, 2, 3]
    engine_masked = mask_logits(logits, [grammar.matcher() for _ in rows], rows)  # the CPU's xgrammar kernel

    def allowed_tokens(batch_id, input_ids):
        return allowed

    ids = torch.ones(len(rows), 2, dtype=torch.long)
    ours = PrefixConstrainedLogitsProcessor(allowed_tokens, num_beams=1)(ids, logits[rows])
    theirs = HFProcessor(allowed_tokens, num_beams=1)(ids, logits[rows].clone())
    mask = torch.zeros(len(rows), VOCAB, dtype=torch.bool)
    mask[:, allowed] = True
    shared = sampling_ops.mask_to_allowed(logits[rows], mask)
    assert torch.equal(engine_masked[rows], shared) and torch.equal(ours, shared) and torch.equal(theirs, shared)
    assert torch.equal(engine_masked[1], logits[1])  # a row without a grammar is left as it is
    assert (shared.argmax(-1) != logits[rows].argmax(-1)).any()  # the mask changes the greedy token


def test_min_tokens_suppression_alike_in_generates_processors_and_the_engines_sampler():
    """Rows 0 and 1 are short of min_new_tokens, rows 2 and 3 are not: both eos tokens go to -inf in the short rows
    only, through transformers' processors, ours, and the engine's sampler (each row its own request)."""
    import transformers.generation.logits_process as hf

    prompt, minimum, eos = [5, 6, 7], 3, [11, 12]
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(4, VOCAB, generator=g)
    logits[:, eos] += 10.0  # eos is every row's greedy token, unless held back
    sequences = []
    for generated in ([], [40, 41], [40, 41, 42], [40, 41, 42, 43, 44]):
        seq = Sequence(f"r{len(generated)}", prompt, SamplingParams(max_new_tokens=NEW, eos_token_ids=tuple(eos),
                                                                    min_new_tokens=minimum))
        for token in generated:
            seq.append_token(token)
        sequences.append(seq)
    adjusted, _ = sampler._adjust_logits(logits, sequences, [0, 1, 2, 3], sampler.TokenCounts(logits.device))
    for row, seq in enumerate(sequences):
        ids = torch.tensor([seq.token_ids])
        expected = hf.MinNewTokensLengthLogitsProcessor(len(prompt), minimum, eos)(ids, logits[row:row + 1].clone())
        assert torch.equal(hf.MinLengthLogitsProcessor(len(prompt) + minimum, eos)(ids, logits[row:row + 1].clone()),
                           expected)
        ours_new = MinNewTokensLengthLogitsProcessor(len(prompt), minimum, eos)(ids, logits[row:row + 1])
        ours_length = MinLengthLogitsProcessor(len(prompt) + minimum, eos)(ids, logits[row:row + 1])
        assert torch.equal(ours_new, expected) and torch.equal(ours_length, expected), row
        assert torch.equal(adjusted[row:row + 1], expected), row
        short = seq.num_output_tokens < minimum
        assert (expected.argmax(-1).item() in eos) == (not short)  # the suppression changes the greedy token


def test_the_stop_rules_alike_in_generates_criteria_and_the_engines_finish_check():
    """On random sequences: generate()'s criteria (ours and transformers'), row by row on the device, say a row is
    done exactly when the engine's StopRules give a finish reason, and that reason is the rule that fired."""
    import transformers.generation.stopping_criteria as hf

    prompt_length, max_new, eos = 4, 6, [7, 9]
    g = torch.Generator().manual_seed(2)
    ours = StoppingCriteriaList([MaxLengthCriteria(prompt_length + max_new), EosTokenCriteria(eos)])
    theirs = hf.StoppingCriteriaList([hf.MaxLengthCriteria(prompt_length + max_new), hf.EosTokenCriteria(eos)])
    rules = StopRules(max_new, eos)
    seen = set()
    for new in range(1, max_new + 1):
        ids = torch.randint(0, 12, (32, prompt_length + new), generator=g)
        done = ours(ids, None)
        assert torch.equal(done, theirs(ids, None))
        for row in range(ids.shape[0]):
            tokens = ids[row, prompt_length:].tolist()
            reason = rules.finish_reason(tokens)
            assert (reason is not None) == bool(done[row]), (tokens, reason)
            if reason is not None:
                assert reason == (FinishReason.EOS if tokens[-1] in eos else FinishReason.LENGTH)
                seen.add(reason)
    assert seen == {FinishReason.EOS, FinishReason.LENGTH}


def test_stop_rules_of_the_engine_request_settings():
    rules = SamplingParams(max_new_tokens=8, eos_token_ids=(2,), stop=[5, [6, 7]], min_new_tokens=3).stop_rules
    assert rules.ending_tokens == (2, 5)
    assert rules.suppresses_endings(2) and not rules.suppresses_endings(3)
    assert rules.finish_reason([1, 6, 7]) == FinishReason.STOP_SEQUENCE
    assert rules.finish_reason([6, 7]) is None  # before min_new_tokens
    assert rules.finish_reason([1, 2]) == FinishReason.EOS
    assert rules.finish_reason([1] * 8) == FinishReason.LENGTH
    ignoring = SamplingParams(max_new_tokens=8, eos_token_ids=(2,), ignore_eos=True, min_new_tokens=3).stop_rules
    assert ignoring.ending_tokens == () and not ignoring.suppresses_endings(0)
    assert ignoring.finish_reason([1, 2]) is None
