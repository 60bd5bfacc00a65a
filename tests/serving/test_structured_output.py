"""Structured outputs (response_format json_object / json_schema, the Responses API's text.format) on the tiny
random Qwen3 with the real Qwen3 tokenizer: the engine API directly, then `gpuformers serve` with the openai client.

Random weights never write JSON by themselves, so every parseable answer here is the grammar's doing; a logit_bias
towards "}" shows it plainly: unconstrained, the answer is "}}}}", constrained, it is "{}"."""

from __future__ import annotations

import json
import threading

import openai
import pytest
import torch

from tests.serving.conftest import MODEL_NAME

pytest.importorskip("xgrammar")

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "colour": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3},
    },
    "required": ["name", "age", "colour", "tags"],
}
PROMPTS = ["Describe a person.", "Who is here?", "a b c d", "Give me JSON now"]


def check_person(text: str) -> None:
    """`text` is JSON that PERSON validates (jsonschema when installed, else the fields by hand)."""
    value = json.loads(text)
    try:
        import jsonschema
    except ImportError:
        assert set(value) == set(PERSON["required"]), value
        assert isinstance(value["name"], str) and len(value["name"]) <= 8
        assert isinstance(value["age"], int) and 0 <= value["age"] <= 150
        assert value["colour"] in ("red", "green", "blue")
        assert isinstance(value["tags"], list) and len(value["tags"]) <= 3
        assert all(isinstance(t, str) and len(t) <= 4 for t in value["tags"])
    else:
        jsonschema.validate(value, PERSON)


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=60)


def chat(server, content: str, **kwargs):
    return client(server).chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": content}], temperature=0,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}, **kwargs.pop("extra_body", {})}, **kwargs)


def at_once(*calls):
    """Run the calls in threads, all in flight together; their results in order."""
    results = [None] * len(calls)

    def run(i):
        results[i] = calls[i]()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


@pytest.fixture(scope="module")
def compiler(reference):
    from gpuformers.engine.structured import StructuredOutputCompiler

    model, tokenizer = reference
    return StructuredOutputCompiler(tokenizer, model.config.vocab_size, model.generation_config.eos_token_ids)


# ---------------------------------------------------------------------------------------------- the parts

def test_tokenizer_info_matches_xgrammars_own_from_transformers(reference, checkpoint):
    """Our TokenizerInfo (from gpuformers' tokenizer) is xgrammar's from_huggingface on transformers' tokenizer,
    except that special tokens other than the stop tokens are never allowed (ours: empty, xgrammar: their text)."""
    import xgrammar
    from transformers import AutoTokenizer

    from gpuformers.engine.structured import tokenizer_info

    model, tokenizer = reference
    vocab, stops = model.config.vocab_size, [151645, 151643]
    ours = tokenizer_info(tokenizer, vocab, stops)
    theirs = xgrammar.TokenizerInfo.from_huggingface(AutoTokenizer.from_pretrained(checkpoint), vocab_size=vocab,
                                                     stop_token_ids=stops)
    assert (ours.vocab_type, ours.add_prefix_space, ours.vocab_size) == (
        theirs.vocab_type, theirs.add_prefix_space, theirs.vocab_size)
    special = {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    assert 151644 in special  # <|im_start|>
    ours_vocab, theirs_vocab = ours.decoded_vocab, theirs.decoded_vocab
    assert all(ours_vocab[i] == (b"" if i in special else theirs_vocab[i]) for i in range(vocab))
    assert set(ours.stop_token_ids) == set(stops)


def test_unpack_bitmask_masks_like_xgrammars_kernel():
    """The device path's bit unpacking (torch) against xgrammar's CPU kernel, on a random bitmask."""
    import xgrammar

    from gpuformers.engine.structured import unpack_bitmask

    generator = torch.Generator().manual_seed(0)
    bitmask = torch.randint(-2**31, 2**31 - 1, (3, 40), dtype=torch.int32, generator=generator)
    logits = torch.randn(3, 1270, generator=generator)  # not a multiple of 32: the last word is partly used
    expected = logits.clone()
    xgrammar.apply_token_bitmask_inplace(expected, bitmask)
    assert torch.equal(logits.masked_fill(~unpack_bitmask(bitmask, 1270), float("-inf")), expected)


def test_missing_xgrammar_says_how_to_install(monkeypatch, reference):
    import sys

    from gpuformers.engine.structured import StructuredOutputCompiler

    monkeypatch.setitem(sys.modules, "xgrammar", None)  # import xgrammar now raises ImportError
    model, tokenizer = reference
    with pytest.raises(ImportError, match="pip install xgrammar"):
        StructuredOutputCompiler(tokenizer, model.config.vocab_size, [151645])


def test_invalid_schema_names_the_problem(compiler):
    bad = {"type": "object", "properties": {"age": {"type": "integer", "minimum": 5, "maximum": 1}}}
    with pytest.raises(ValueError, match="json_schema 'x' cannot be compiled into a grammar: Invalid range: "
                                         "minimum greater than maximum"):
        compiler.compile({"type": "json_schema", "name": "x", "schema": bad})
    assert compiler.compile({"type": "json_schema", "schema": PERSON}) is compiler.compile(
        {"type": "json_schema", "schema": json.loads(json.dumps(PERSON))})  # compiled once per schema


# ---------------------------------------------------------------------------------------------- the engine

def test_engine_api_with_async_batching_and_preemption(reference, compiler):
    """add_request(structured_output=grammar) directly: schema-valid answers under async batching with a cache
    so small that requests are preempted and recomputed (their matchers keep their place), while the unconstrained
    requests of the same batches give the tokens they give alone."""
    model, tokenizer = reference
    grammar = compiler.compile({"type": "json_schema", "name": "person", "schema": PERSON})
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    settings = dict(max_new_tokens=60, use_async_batching=True, block_size=16, num_blocks=14)
    alone = model.init_continuous_batching(**settings)
    alone_ids = [alone.add_request(p) for p in prompts]
    alone.run_until_done()
    expected = [alone.get_result(i, timeout=0).generated_tokens for i in alone_ids]

    manager = model.init_continuous_batching(**settings)
    free_ids = [manager.add_request(p) for p in prompts]
    json_ids = [manager.add_request(p, structured_output=grammar) for p in prompts]
    manager.run_until_done()
    assert manager.num_preemptions > 0
    for request_id in json_ids:
        output = manager.get_result(request_id, timeout=0)
        # the checkpoint's generation config has no eos ids: the grammar ends at the tokenizer's eos
        assert output.error is None and output.generated_tokens[-1] == tokenizer.eos_token_id
        check_person(tokenizer.decode(output.generated_tokens, skip_special_tokens=True))
    assert [manager.get_result(i, timeout=0).generated_tokens for i in free_ids] == expected
    with pytest.raises(TypeError, match="StructuredOutputCompiler"):
        manager.add_request(prompts[0], structured_output={"type": "json_object"})


def test_a_grammar_with_no_way_on_fails_its_sampled_request_alone(reference, compiler):
    """A grammar that can start but never finish ("a" then an endless recursion) allows no token after "a": a sampled
    row masked to all -inf used to give NaN probabilities that failed every request of the step."""
    model, tokenizer = reference
    dead_end = compiler.compile({"type": "grammar", "grammar": 'root ::= "a" b\nb ::= b "x"'})
    prompt = tokenizer.encode(PROMPTS[0])
    manager = model.init_continuous_batching(max_new_tokens=8)
    other = manager.add_request(prompt, do_sample=True, seed=1)
    stuck = manager.add_request(prompt, do_sample=True, seed=2, structured_output=dead_end)
    manager.run_until_done()
    assert "does not fit grammar" in manager.get_result(stuck, timeout=0).error
    output = manager.get_result(other, timeout=0)
    assert output.error is None and len(output.generated_tokens) == 8


# ---------------------------------------------------------------------------------------------- the server

def test_json_object_is_forced_for_requests_at_once(server, reference):
    """Several json_object requests in flight together all parse; the same requests unconstrained (in the same
    batches) answer "}}}..." and their tokens do not change because of their neighbours."""
    _, tokenizer = reference
    bias = {str(tokenizer.encode("}")[0]): 100}
    json_calls = [lambda p=p: chat(server, p, max_tokens=20, logit_bias=bias, response_format={"type": "json_object"})
                  for p in PROMPTS[:3]]
    free_calls = [lambda p=p: chat(server, p, max_tokens=20, logit_bias=bias) for p in PROMPTS[:2]]
    alone = [call() for call in free_calls]
    answers = at_once(*json_calls, *free_calls)
    for answer in answers[:3]:
        choice = answer.choices[0]
        assert choice.finish_reason == "stop" and json.loads(choice.message.content) == {}
    for answer, reference_answer in zip(answers[3:], alone):
        assert answer.choices[0].message.content == reference_answer.choices[0].message.content
        assert answer.choices[0].message.content.startswith("}}")


def test_json_schema_answers_validate(server):
    response_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    answers = at_once(*[lambda p=p: chat(server, p, max_tokens=80, response_format=response_format)
                        for p in PROMPTS])
    for answer in answers:
        assert answer.choices[0].finish_reason == "stop"
        check_person(answer.choices[0].message.content)


def test_max_tokens_cutting_the_json_short_is_length(server):
    response_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    answer = chat(server, PROMPTS[0], max_tokens=4, response_format=response_format)
    assert answer.choices[0].finish_reason == "length" and answer.usage.completion_tokens == 4
    assert answer.choices[0].message.content.startswith('{"')
    with pytest.raises(json.JSONDecodeError):
        json.loads(answer.choices[0].message.content)


def test_responses_text_format_json_schema(server):
    text_format = {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}
    response = client(server).responses.create(model=MODEL_NAME, input=PROMPTS[1], max_output_tokens=80,
                                                temperature=0, text={"format": text_format})
    check_person(response.output_text)
    assert response.text.format.type == "json_schema" and response.text.format.name == "person"


@pytest.mark.parametrize("response_format, param, words", [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "integer", "minimum": 5, "maximum": 1}}}}},
     "response_format", "minimum greater than maximum"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "wizard"}}}, "response_format",
     'Unsupported type "wizard"'),
    ({"type": "xml"}, "response_format.type", "json_schema"),
    ({"type": "json_schema", "schema": {}}, "response_format.json_schema", '"json_schema": {"name"'),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}, "response_format.json_schema.schema",
     "must be an object"),
])
def test_bad_response_format_is_a_400_naming_the_problem(server, response_format, param, words):
    with pytest.raises(openai.BadRequestError) as error:
        chat(server, "hi", max_tokens=5, response_format=response_format)
    body = error.value.body
    assert body["type"] == "invalid_request_error" and body["param"] == param and words in body["message"]


def test_min_tokens_with_a_grammar_is_a_400(server):
    with pytest.raises(openai.BadRequestError) as error:
        chat(server, "hi", max_tokens=5, response_format={"type": "json_object"}, extra_body={"min_tokens": 3})
    assert error.value.body["param"] == "min_tokens" and "grammar" in error.value.body["message"]


def test_a_tensor_parallel_server_refuses_grammars_with_a_400():
    """Under tensor parallelism every process would need a matcher: the request is refused, never a 500."""
    from types import SimpleNamespace

    from gpuformers.serving.api_error import APIError
    from gpuformers.serving.server import _State

    state = SimpleNamespace(manager=SimpleNamespace(model=SimpleNamespace(tp_plan="auto")))
    with pytest.raises(APIError) as error:
        _State.compile_grammar(state, {"type": "json_object"}, "response_format")
    assert error.value.status == 400 and error.value.param == "response_format"
    assert "tensor-parallel" in str(error.value)


def test_bad_text_format_is_a_400_naming_the_problem(server):
    with pytest.raises(openai.BadRequestError) as error:
        client(server).responses.create(model=MODEL_NAME, input="hi", text={"format": {"type": "xml"}})
    assert error.value.body["param"] == "text.format.type" and "json_schema" in error.value.body["message"]


# ------------------------------------------------------------------------- regex, choice and EBNF grammars

CHOICES = ["yes", 'say "no"', "back\\slash", "tab\tline\nbreak"]
REGEX = r"[0-9]{3}-[a-z]{2}"
EBNF = 'root ::= "(" item ("," item)? ")"\nitem ::= [a-c] [a-c]?'  # at most 7 characters: ends in 24 tokens


def _constrained(reference, grammar, prompts) -> list[str]:
    model, tokenizer = reference
    manager = model.init_continuous_batching(max_new_tokens=24)
    ids = [manager.add_request(tokenizer.encode(p), structured_output=grammar) for p in prompts]
    manager.run_until_done()
    outputs = [manager.get_result(i, timeout=0) for i in ids]
    assert all(o.error is None and o.generated_tokens[-1] == tokenizer.eos_token_id for o in outputs)
    return [tokenizer.decode(o.generated_tokens, skip_special_tokens=True) for o in outputs]


def test_regex_choice_and_grammar_hold_the_engines_answers(reference, compiler):
    import re

    choice = compiler.compile({"type": "choice", "choices": CHOICES})
    assert compiler.compile({"type": "choice", "choices": list(CHOICES)}) is choice  # compiled once
    assert set(_constrained(reference, choice, PROMPTS)) <= set(CHOICES)
    for text in _constrained(reference, compiler.compile({"type": "regex", "regex": REGEX}), PROMPTS):
        assert re.fullmatch(REGEX, text), text
    for text in _constrained(reference, compiler.compile({"type": "grammar", "grammar": EBNF}), PROMPTS[:2]):
        assert re.fullmatch(r"\([a-c]{1,2}(,[a-c]{1,2})?\)", text), text
    with pytest.raises(ValueError, match="regex cannot be compiled into a grammar"):
        compiler.compile({"type": "regex", "regex": "([a-"})
    with pytest.raises(ValueError, match="grammar cannot be compiled into a grammar"):
        compiler.compile({"type": "grammar", "grammar": "root ::= missing_rule"})


def test_vllm_structured_outputs_on_completions_and_chat(server):
    import re

    completion = client(server).completions.create(model=MODEL_NAME, prompt="Pick one:", max_tokens=24,
                                                   temperature=0, extra_body={"structured_outputs": {"choice": CHOICES}})
    assert completion.choices[0].text in CHOICES and completion.choices[0].finish_reason == "stop"
    answer = chat(server, "Code?", max_tokens=24, extra_body={"guided_regex": REGEX})
    assert re.fullmatch(REGEX, answer.choices[0].message.content)
    answer = chat(server, "JSON?", max_tokens=60, extra_body={"structured_outputs": {"json": PERSON}})
    check_person(answer.choices[0].message.content)


@pytest.mark.parametrize("fields, param, words", [
    ({"structured_outputs": {"regex": "a+", "choice": ["a"]}}, "structured_outputs", "exactly one of"),
    ({"structured_outputs": {"whitespace_pattern": " "}}, "structured_outputs.whitespace_pattern", "unknown"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice", "non-empty list"),
    ({"guided_regex": "a+", "guided_choice": ["a"]}, "guided_choice", "send one of them"),
    ({"structured_outputs": {"regex": "([a-"}}, "structured_outputs", "regex cannot be compiled"),
    ({"guided_grammar": "root ::= nothing_here"}, "guided_grammar", "cannot be compiled"),
    ({"guided_choice": ["a"], "min_tokens": 2}, "min_tokens", "grammar decides"),
])
def test_bad_vllm_structured_outputs_are_a_400(server, fields, param, words):
    with pytest.raises(openai.BadRequestError) as error:
        client(server).completions.create(model=MODEL_NAME, prompt="hi", max_tokens=5, extra_body=fields)
    body = error.value.body
    assert body["type"] == "invalid_request_error" and body["param"] == param and words in body["message"], body
    with pytest.raises(openai.BadRequestError) as error:  # and never with response_format on chat
        chat(server, "hi", max_tokens=5, response_format={"type": "json_object"},
             extra_body={"structured_outputs": {"regex": "a+"}})
    assert "send one of them" in error.value.body["message"]


# ---------------------------------------------------------------------------------------------- on a GPU

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_engine_on_cuda_with_graphs_and_async_batching(checkpoint, reference, compiler):
    """The device path: the bitmask through pinned memory, unpacked on the device, CUDA graphs replaying the decode
    steps and async batching collecting the constrained steps early; unconstrained neighbours unchanged."""
    from gpuformers import AutoModelForCausalLM
    from gpuformers.engine.structured import mask_logits

    _, tokenizer = reference
    grammar = compiler.compile({"type": "json_schema", "name": "person", "schema": PERSON})
    matchers = [grammar.matcher() for _ in range(2)]
    logits = torch.randn(3, grammar.vocab_size)
    assert torch.equal(mask_logits(logits.cuda(), matchers, [0, 2]).cpu(), mask_logits(logits, matchers, [0, 2]))

    model = AutoModelForCausalLM.from_pretrained(checkpoint, progress=False).to("cuda")
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    alone = model.init_continuous_batching(max_new_tokens=60, block_size=16, num_blocks=64)
    alone_ids = [alone.add_request(p) for p in prompts]
    alone.run_until_done()
    manager = model.init_continuous_batching(max_new_tokens=60, block_size=16, num_blocks=64)
    assert manager.config.use_cuda_graph and manager.config.use_async_batching
    free_ids = [manager.add_request(p) for p in prompts]
    json_ids = [manager.add_request(p, structured_output=grammar) for p in prompts]
    manager.run_until_done()
    for request_id in json_ids:
        output = manager.get_result(request_id, timeout=0)
        assert output.error is None and output.generated_tokens[-1] == tokenizer.eos_token_id
        check_person(tokenizer.decode(output.generated_tokens, skip_special_tokens=True))
    assert ([manager.get_result(i, timeout=0).generated_tokens for i in free_ids]
            == [alone.get_result(i, timeout=0).generated_tokens for i in alone_ids])


def test_the_engine_writes_a_forced_tool_call(server):
    """tool_choice naming a function on random weights: the grammar writes the whole call in the template's format,
    arguments its schema allows, and the answer ends after it (serving/answer_grammar.py)."""
    zones = ["utc", "cet", "pst"]
    tool = {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"enum": zones}}, "required": ["zone"]}}}
    answer = chat(server, PROMPTS[1], max_tokens=60, tools=[tool],
                  tool_choice={"type": "function", "function": {"name": "get_time"}})
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0].function
    assert call.name == "get_time" and json.loads(call.arguments)["zone"] in zones
