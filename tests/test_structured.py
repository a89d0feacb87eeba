"""Structured output (lmserve/structured.py): constrained decoding with xgrammar on the real default
model. Every output is checked by an independent reader (Python's json and re), the bitmask against
xgrammar's own kernel, speculation against the same request without it, bad constraints by the field
named in the error."""

from __future__ import annotations

import json
import re

import pytest
import torch

xgr = pytest.importorskip("xgrammar")

from lmserve import SamplingParams, StructuredOutputsParams  # noqa: E402
from lmserve.structured import apply_bitmask  # noqa: E402


@pytest.fixture
def smol(smol_default):  # type: ignore[no-untyped-def]
    """The default model as users run it (quantization auto): what the constraints are checked on here
    (every check reads the outputs themselves, none compares with HF's float weights)."""
    return smol_default

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
          "required": ["name", "age", "tags"], "additionalProperties": False}


def greedy(max_tokens: int, **constraint) -> SamplingParams:  # type: ignore[no-untyped-def]
    return SamplingParams(max_tokens=max_tokens, temperature=0, structured_outputs=StructuredOutputsParams(**constraint))


def check_person(text: str) -> None:
    obj = json.loads(text)
    assert set(obj) == {"name", "age", "tags"}
    assert isinstance(obj["name"], str) and len(obj["name"]) <= 12
    assert isinstance(obj["age"], int) and 0 <= obj["age"] <= 120
    assert isinstance(obj["tags"], list) and len(obj["tags"]) <= 3 and set(obj["tags"]) <= {"a", "b"}


def test_bitmask_equals_xgrammar_kernel():
    """Our torch unpacking of the bitmask masks exactly what xgrammar's own kernel masks."""
    g = torch.Generator().manual_seed(0)
    for v in (2, 31, 32, 33, 1000, 49152):  # (a 1-wide vocabulary trips xgrammar's kernel, not ours)
        logits = torch.randn(4, v, generator=g)
        mask = torch.randint(-2**31, 2**31 - 1, (4, (v + 31) // 32), generator=g, dtype=torch.int64).to(torch.int32)
        mask[1] = -1  # a row that allows everything
        ours = apply_bitmask(logits.clone(), mask)
        ref = logits.clone()
        xgr.apply_token_bitmask_inplace(ref, mask)
        assert torch.equal(ours, ref), v  # float32 on the CPU: our C loop (layers/csrc/fused.c)
        assert torch.equal(ours[1], logits[1])
        assert torch.equal(apply_bitmask(logits.double(), mask), ref.double()), v  # the torch path


def test_json_schema_regex_choice_grammar_greedy(smol):  # type: ignore[no-untyped-def]
    """Each kind of constraint, greedy: the output is what the constraint says, read back by Python;
    without the constraint the same prompt's output is not (so the mask did the work)."""
    llm = smol
    prompt = "Describe a person as JSON:"
    free = llm.generate([prompt], SamplingParams(max_tokens=40, temperature=0), use_tqdm=False)[0].outputs[0].text
    with pytest.raises(ValueError):
        check_person(free)
    out = llm.generate([prompt], greedy(80, json=SCHEMA), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop", out.text
    check_person(out.text)
    outs = llm.generate(["Call me at", "The code is"], greedy(20, regex=r"\(\d{3}\) \d{3}-\d{4}"), use_tqdm=False)
    for o in outs:
        assert re.fullmatch(r"\(\d{3}\) \d{3}-\d{4}", o.outputs[0].text) and o.outputs[0].finish_reason == "stop"
    o = llm.generate(["Is the sky green? Answer:"], greedy(10, choice=["yes", "no", "maybe so"]), use_tqdm=False)[0]
    assert o.outputs[0].text in ("yes", "no", "maybe so")
    ebnf = 'root ::= "[" num ("," num)* "]"\nnum ::= [1-9] [0-9]?'
    o = llm.generate(["Some small numbers:"], greedy(30, grammar=ebnf), use_tqdm=False)[0].outputs[0]
    assert o.finish_reason == "stop" and re.fullmatch(r"\[[1-9][0-9]?(,[1-9][0-9]?)*\]", o.text), o.text
    o = llm.generate(["A JSON object:"], greedy(40, json_object=True), use_tqdm=False)[0].outputs[0]
    assert o.finish_reason != "stop" or isinstance(json.loads(o.text), dict)
    assert o.text.lstrip().startswith("{")


def test_json_object_is_an_object(smol):  # type: ignore[no-untyped-def]
    """json_object (OpenAI's JSON mode) took any JSON value: with '[' favoured the answer was '[[[[...',
    and sampled answers were mostly arrays ('[null]', '[true]'). Every answer is an object now."""
    bracket = smol.tokenizer.encode("[", add_special_tokens=False)
    assert len(bracket) == 1
    favour = SamplingParams(max_tokens=12, temperature=0, logit_bias={bracket[0]: 100.0},
                            structured_outputs=StructuredOutputsParams(json_object=True))
    o = smol.generate(["JSON:"], favour, use_tqdm=False)[0]
    assert o.outputs[0].text.startswith("{"), o.outputs[0].text
    params = [SamplingParams(max_tokens=40, temperature=1.0, seed=s,
                             structured_outputs=StructuredOutputsParams(json_object=True)) for s in range(12)]
    outs = smol.generate(["Some JSON:"] * 12, params, use_tqdm=False)
    done = [o.outputs[0].text for o in outs if o.outputs[0].finish_reason == "stop"]
    assert all(isinstance(json.loads(t), dict) for t in done) and all(o.outputs[0].text.startswith("{") for o in outs)


def test_sampled_outputs_always_obey(smol):  # type: ignore[no-untyped-def]
    """Temperature 1.2, eight seeds, n = 2: every sample parses against the schema or the regex."""
    llm = smol
    params = SamplingParams(max_tokens=80, temperature=1.2, n=2, structured_outputs=StructuredOutputsParams(json=SCHEMA))
    outs = llm.generate([SamplingParams and "A person:"] * 4, [SamplingParams(**{**params.__dict__, "seed": s})
                                                               for s in range(4)], use_tqdm=False)
    for o in outs:
        assert len(o.outputs) == 2
        for c in o.outputs:
            if c.finish_reason == "stop":
                check_person(c.text)
    pat = r"[A-Z][a-z]{2,8}( [A-Z][a-z]{2,8})?"
    params = [SamplingParams(max_tokens=20, temperature=1.2, seed=s, structured_outputs=StructuredOutputsParams(regex=pat))
              for s in range(8)]
    for o in llm.generate(["Name:"] * 8, params, use_tqdm=False):
        assert re.fullmatch(pat, o.outputs[0].text), o.outputs[0].text


def test_speculation_with_a_grammar_gives_the_same_tokens(tmp_path):  # type: ignore[no-untyped-def]
    """n-gram drafts (which copy the prompt and ignore the grammar) are verified under the grammar's
    mask: a forbidden draft is rejected, the output equals the same request without speculation."""
    from lmserve import LLM
    prompt = "abc abc abc abc 12 34 56 78 12 34 56 78 12 34 56 78 12 34"
    pat = r"( [0-9]{2}){6} [a-z]{3}"
    plain = LLM(quantization="none", kv_cache_memory="256MiB")
    want = plain.generate([prompt], greedy(30, regex=pat), use_tqdm=False)[0].outputs[0]
    del plain
    spec = LLM(quantization="none", kv_cache_memory="256MiB", speculative_method="ngram", num_speculative_tokens=5)
    got = spec.generate([prompt], greedy(30, regex=pat), use_tqdm=False)[0].outputs[0]
    assert got.token_ids == want.token_ids and re.fullmatch(pat, got.text), (got.text, want.text)
    st = spec.stats().spec
    assert st["proposed"] > 0 and st["accepted"] < st["proposed"], st  # drafts ran, some were refused


def test_speculation_reaching_a_position_nothing_can_pass_ends_as_one_token_at_a_time_does():  # type: ignore[no-untyped-def]
    """allowed_token_ids (the digits) and a grammar (two digits, two letters) leave no token for the third
    position; n-gram drafts copy "12ab" from the prompt. The request must end as it does without
    speculation: "12", then a 400 naming allowed_token_ids (before, the dead row's all -inf logits made a
    NaN probability that verification took as acceptance: the forbidden "ab" came out, then a 500; greedy
    lost a character of its text to the failure), or, with the stop string "2", a stop there; and
    generation_tokens counts the tokens kept either way."""
    from lmserve import LLM
    prompt = "12ab12ab12ab12ab12ab12ab12ab"
    outs = {}
    for spec in (False, True):
        llm = LLM(quantization="none", kv_cache_memory="256MiB",
                  **({"speculative_method": "ngram", "num_speculative_tokens": 4} if spec else {}))
        digits = [llm.tokenizer.encode(str(d), add_special_tokens=False)[0] for d in range(10)]
        params = [SamplingParams(max_tokens=8, temperature=t, seed=s, allowed_token_ids=digits, stop=stop,
                                 structured_outputs=StructuredOutputsParams(regex="[0-9]{2}[a-z]{2}"))
                  for t, s, stop in ((0, None, None), (1.0, 0, None), (1.0, 1, None), (0, None, ["2"]))]
        outs[spec] = [o.outputs[0] for o in llm.generate([prompt] * 4, params, use_tqdm=False)]
        assert llm.stats().generation_tokens == sum(len(o.token_ids) for o in outs[spec])  # what they kept
        if spec:
            assert llm.stats().spec["proposed"] > 0  # drafts ran
        del llm
    stopped = [outs[False].pop(), outs[True].pop()]
    for o in stopped:  # a stop string before the dead position ends it first, as one token at a time does
        assert (o.finish_reason, o.stop_reason, o.text, o.error) == ("stop", "2", "1", None), o
    assert stopped[0].token_ids == stopped[1].token_ids
    for plain, spec in zip(outs[False], outs[True]):
        assert plain.finish_reason == spec.finish_reason == "error", (plain, spec)
        assert spec.error_status == 400 and "allowed_token_ids" in spec.error, spec
        assert all(t in range(32, 42) for t in spec.token_ids) and len(spec.token_ids) == 2, spec
        assert spec.text.isdigit() and len(spec.text) == 2, spec
    assert outs[False][0].token_ids == outs[True][0].token_ids and outs[False][0].text == outs[True][0].text


def test_fill_rolls_back_and_stops_at_a_forbidden_draft(smol):  # type: ignore[no-untyped-def]
    """The bitmask rows of a speculating sequence: one per position, all ones after a draft the grammar
    refuses; the matcher is where it was afterwards (the same rows again)."""
    from lmserve.sequence import Sequence
    eng = smol.engine
    tok = eng.tokenizer
    seq = Sequence("r", [1, 2, 3], greedy(10, regex="[0-9]+"), eos_token_ids=tuple(tok.eos_token_ids))
    eng.structured.start(seq)
    digits, letters = tok.encode("12", add_special_tokens=False), tok.encode("ab", add_special_tokens=False)
    rows = eng.structured.fill([(seq, digits + letters + digits)])[seq]
    k = len(digits)
    assert rows.shape[0] == 2 * k + len(letters) + 1
    allowed = [(((r.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).reshape(-1) > 0) for r in rows]
    assert allowed[0][digits[0]] and not allowed[0][letters[0]]
    assert not allowed[k][letters[0]]  # the forbidden draft's position
    assert all(a.all() for a in allowed[k + 1:])  # after it: anything (verification rejects first)
    again = eng.structured.fill([(seq, digits + letters + digits)])[seq]
    assert torch.equal(rows, again)


def test_bad_constraints_name_their_field(smol):  # type: ignore[no-untyped-def]
    llm = smol
    cases = [(dict(regex="(unclosed"), "structured_outputs.regex"), (dict(json={"type": 5}), "structured_outputs.json"),
             (dict(json="{nope"), "structured_outputs.json"), (dict(grammar="root ::= undefined_rule"),
                                                               "structured_outputs.grammar"),
             (dict(choice=[]), "structured_outputs.choice"), (dict(regex="a", choice=["b"]), "structured_outputs"),
             (dict(), "structured_outputs")]
    for kw, field in cases:
        with pytest.raises(ValueError, match=re.escape(field)):
            llm.generate(["hi"], SamplingParams(max_tokens=2, structured_outputs=StructuredOutputsParams(**kw)),
                         use_tqdm=False)
    with pytest.raises(ValueError, match="structured_outputs"):
        SamplingParams(use_beam_search=True, n=2, structured_outputs=StructuredOutputsParams(regex="a"))
    assert llm.generate(["hi"], greedy(3, regex="ok"), use_tqdm=False)[0].outputs[0].text == "ok"  # still serving
    assert llm.stats().used_blocks == 0


def test_cli_generate_with_a_json_schema(tmp_path, capsys):  # type: ignore[no-untyped-def]
    from lmserve.cli import main
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(SCHEMA))
    assert main(["generate", "A person as JSON:", "--json-schema", str(path), "--max-tokens", "80", "--json",
                 "--quantization", "none"]) == 0
    text = json.loads(capsys.readouterr().out)["outputs"][0]["text"]
    check_person(text)
    assert main(["generate", "x", "--regex", "[", "--quantization", "none"]) == 2
    assert "structured_outputs.regex" in capsys.readouterr().err


def test_a_grammar_slower_than_the_timeout_is_refused(smol):  # type: ignore[no-untyped-def]
    """A compile that takes longer than grammar_compile_timeout is a ValueError naming the field; the
    engine goes on serving (and the same constraint compiles once the limit allows it)."""
    s = smol.engine.structured
    saved = s.compile_timeout
    schema = {"type": "object", "properties": {f"k{i}": {"type": "string", "pattern": "[a-z]{3}[0-9]{2}"}
                                               for i in range(40)}, "required": ["k1"]}
    try:
        s.compile_timeout = 1e-6
        with pytest.raises(ValueError, match=r"structured_outputs.json: took longer than"):
            smol.generate(["x"], greedy(4, json=schema), use_tqdm=False)
    finally:
        s.compile_timeout = saved
    assert smol.generate(["x"], greedy(4, json=schema), use_tqdm=False)[0].outputs[0].text.startswith("{")


def _schemas():  # type: ignore[no-untyped-def]
    """Random JSON schemas: nested objects (required and optional keys), arrays, enums, bounded numbers."""
    from hypothesis import strategies as st
    leaf = st.one_of(
        st.builds(lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
                  st.integers(-50, 50), st.integers(0, 200)),
        st.builds(lambda lo: {"type": "number", "minimum": lo, "maximum": lo + 10}, st.integers(-5, 5)),
        st.just({"type": "boolean"}),
        st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(1, 6)),
        st.lists(st.text(alphabet="abxyz", min_size=1, max_size=4), min_size=1, max_size=4, unique=True)
        .map(lambda xs: {"enum": xs}))

    def obj(children):  # type: ignore[no-untyped-def]
        props = st.dictionaries(st.sampled_from(["a", "b", "c", "d"]), children, min_size=1, max_size=3)
        return props.flatmap(lambda p: st.lists(st.sampled_from(sorted(p)), unique=True).map(
            lambda req: {"type": "object", "properties": p, "required": req, "additionalProperties": False}))

    nested = st.recursive(leaf, lambda ch: st.one_of(
        st.builds(lambda items, n: {"type": "array", "items": items, "maxItems": n}, ch, st.integers(0, 3)),
        obj(ch)), max_leaves=5)
    return obj(nested)


def test_random_schemas_sampled_outputs_validate(smol):  # type: ignore[no-untyped-def]
    """Hypothesis draws JSON schemas; temperature-1 samples under each are validated by jsonschema (an
    independent validator). Outputs cut by max_tokens are not complete documents: most must finish."""
    jsonschema = pytest.importorskip("jsonschema")
    from hypothesis import HealthCheck, given, settings

    finished = []

    @settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
    @given(schema=_schemas())
    def check(schema):  # type: ignore[no-untyped-def]
        params = [SamplingParams(max_tokens=120, temperature=1.0, seed=s,
                                 structured_outputs=StructuredOutputsParams(json=schema)) for s in range(2)]
        for o in smol.generate(["Some JSON data:"] * 2, params, use_tqdm=False):
            c = o.outputs[0]
            finished.append(c.finish_reason == "stop")
            if c.finish_reason == "stop":
                jsonschema.validate(json.loads(c.text), schema)

    check()
    assert sum(finished) >= 0.75 * len(finished), finished


def test_greedy_constrained_equals_free_when_free_conforms(smol):  # type: ignore[no-untyped-def]
    """Where the model's own greedy answer already obeys the constraint, the constrained answer is the
    same tokens (the mask removed nothing the model wanted)."""
    tok = smol.tokenizer
    pat = r"[A-Za-z0-9 ,.!?'\n-]+"
    asks = ["Reply with one word: the color of the sky.", "Say hello.", "What is 2 + 3? Answer with a number.",
            "Name a fruit. One word.", "Is water wet? Answer yes or no."]
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": a}]), add_special_tokens=False)
               for a in asks]
    free = smol.generate(prompts, SamplingParams(max_tokens=64, temperature=0), use_tqdm=False)
    conforming = [(p, o.outputs[0]) for p, o in zip(prompts, free)
                  if o.outputs[0].finish_reason == "stop" and re.fullmatch(pat, o.outputs[0].text)]
    assert len(conforming) >= 2, [o.outputs[0].text for o in free]
    # the free answers again in the batch the constrained ones run in, the prompts' blocks cached for both:
    # a different batch or cache state changes float rounding, which the default model's int8
    # activations can amplify into another greedy token at a near tie (the mask is what is tested here)
    batch = [p for p, _ in conforming]
    want = smol.generate(batch, SamplingParams(max_tokens=64, temperature=0), use_tqdm=False)
    got = smol.generate(batch, greedy(64, regex=pat), use_tqdm=False)
    for w, o in zip(want, got):
        assert o.outputs[0].token_ids == w.outputs[0].token_ids, (o.outputs[0].text, w.outputs[0].text)


def test_min_tokens_never_forces_a_token_the_grammar_forbids(smol):  # type: ignore[no-untyped-def]
    """min_tokens longer than the grammar's whole output: once the grammar is complete only the stop
    token is allowed, and min_tokens must not ban it (that left every logit -inf and a forbidden token
    came out). The grammar wins: the output is the choice and the request stops, greedy and sampled."""
    llm = smol
    for temp in (0.0, 1.0):
        params = SamplingParams(max_tokens=30, min_tokens=20, temperature=temp, seed=3,
                                structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
        o = llm.generate(["Is the sky green? Answer:"], params, use_tqdm=False)[0].outputs[0]
        assert o.text in ("yes", "no"), o.text
        assert o.finish_reason == "stop", o.finish_reason


def test_a_token_the_grammar_refuses_is_never_emitted(smol):  # type: ignore[no-untyped-def]
    """Should a token the grammar refuses ever be kept (a bug upstream of the bitmask), it is not
    shown: the output stays a prefix the grammar accepts and the request ends with an error."""
    from lmserve.structured import StructuredOutputs
    llm = smol
    real = StructuredOutputs.fill

    def allow_all(self, rows):  # type: ignore[no-untyped-def]
        masks = real(self, rows)
        return {s: torch.full_like(m, -1) for s, m in masks.items()}  # the mask stops masking

    StructuredOutputs.fill = allow_all
    try:
        o = llm.generate(["Describe a person as JSON:"], greedy(40, regex=r"[0-9]+"), use_tqdm=False)[0].outputs[0]
    finally:
        StructuredOutputs.fill = real
    assert o.finish_reason == "error"
    assert re.fullmatch(r"[0-9]*", o.text), o.text


def test_control_tokens_are_never_text_inside_a_constraint(smol):  # type: ignore[no-untyped-def]
    """The tokenizer's special tokens (<|im_start|>, <|endoftext|>, ...) are never allowed as text: inside
    a JSON string the grammar allowed them by their spelling, and the detokenizer then dropped them (on
    Gemma 3, a string of 12 characters came out with 3). Ordinary tokens stay allowed; EOS ends the output
    where the grammar may end."""
    import xgrammar as xgr
    llm = smol
    tok, so = llm.tokenizer, llm.engine.structured
    special = sorted(i for i, t in tok.raw.get_added_tokens_decoder().items() if t.special)
    assert len(special) >= 3
    grammar = so.compile(StructuredOutputsParams(json={"type": "object", "properties": {"name": {"type": "string"}},
                                                       "required": ["name"]}))
    m = xgr.GrammarMatcher(grammar)
    for t in tok.encode('{"name": "', add_special_tokens=False):
        assert m.accept_token(t)
    mask = xgr.allocate_token_bitmask(1, llm.engine.vocab_size)
    m.fill_next_token_bitmask(mask)

    def allowed(i: int) -> bool:
        return bool((int(mask[0, i // 32]) >> (i % 32)) & 1)

    assert [i for i in special if allowed(i)] == []
    assert allowed(tok.encode(" Paris", add_special_tokens=False)[0])
    done = xgr.GrammarMatcher(grammar)
    for t in tok.encode('{"name": "x"}', add_special_tokens=False):
        assert done.accept_token(t)
    done.fill_next_token_bitmask(mask)
    assert all(allowed(e) for e in tok.eos_token_ids)
    # an output pushed toward a control token still holds to the schema
    bias = {i: 30.0 for i in special if i not in tok.eos_token_ids}
    o = llm.generate(["A name:"], SamplingParams(max_tokens=40, temperature=0, logit_bias=bias,
                                                 structured_outputs=StructuredOutputsParams(json={
                                                     "type": "object", "properties": {"code": {
                                                         "type": "string", "minLength": 5, "maxLength": 5}},
                                                     "required": ["code"]})), use_tqdm=False)[0].outputs[0]
    assert not set(o.token_ids) & set(bias), o.token_ids
    if o.finish_reason == "stop":
        assert len(json.loads(o.text)["code"]) == 5


def test_allowed_tokens_that_cannot_continue_a_constraint_fail_the_request(smol):  # type: ignore[no-untyped-def]
    """allowed_token_ids none of which the grammar allows next: the request ends with an error naming
    the field (a 400 on the server), not with a token neither allows (every logit was masked)."""
    llm = smol
    allowed = llm.tokenizer.encode(" maybe", add_special_tokens=False)
    o = llm.generate(["Answer:"], SamplingParams(max_tokens=4, temperature=0, allowed_token_ids=allowed,
                                                 structured_outputs=StructuredOutputsParams(choice=["yes", "no"])),
                     use_tqdm=False)[0].outputs[0]
    assert o.finish_reason == "error" and "allowed_token_ids" in o.error and o.error_status == 400, o
    assert o.text == ""


def test_bad_words_that_leave_a_constraint_nothing_fail_the_request_with_a_400():  # type: ignore[no-untyped-def]
    """bad_words the grammar needs: every digit banned where the grammar wants one, or the word "123"
    where the grammar wants its last token after "12" (found at that position inside an n-gram draft
    window too). The request ends with a 400 naming bad_words, the tokens before kept (before, the
    sampler drew from an all -inf row and the grammar's refusal was a 500)."""
    from lmserve import LLM
    for spec in (False, True):
        llm = LLM(quantization="none", kv_cache_memory="256MiB",
                  **({"speculative_method": "ngram", "num_speculative_tokens": 4} if spec else {}))
        every, word = llm.generate(["Numbers: 12", "123123123123123123123123"], [
            SamplingParams(max_tokens=6, temperature=0, bad_words=[str(d) for d in range(10)],
                           structured_outputs=StructuredOutputsParams(regex="[0-9]{2}")),
            SamplingParams(max_tokens=6, temperature=0, bad_words=["123"],
                           structured_outputs=StructuredOutputsParams(regex="123"))], use_tqdm=False)
        for o, text in ((every.outputs[0], ""), (word.outputs[0], "12")):
            assert o.finish_reason == "error" and o.error_status == 400 and "bad_words" in o.error, (spec, o)
            assert o.text == text, (spec, o)
        if spec:
            assert llm.stats().spec["proposed"] > 0
        del llm


def test_children_reuse_the_requests_compiled_grammar(smol):  # type: ignore[no-untyped-def]
    """n = 3: the request's grammar is compiled once, when it is validated; the children forked on the
    engine's thread take it from the request, never compile again (a compile there, slow or failing,
    would have stopped every request in the engine)."""
    from lmserve.structured import StructuredOutputs
    eng = smol.engine
    params = SamplingParams(max_tokens=12, temperature=1.0, n=3, seed=1,
                            structured_outputs=StructuredOutputsParams(regex=r"[a-z]{2,6}-[0-9]{2}"))
    req = eng.process_request("An identifier:", params)
    real = StructuredOutputs._compile

    def broken(self, *a):  # type: ignore[no-untyped-def]
        raise ValueError("structured_outputs.regex: compiled on the engine's thread")

    eng.structured._cache.clear()
    StructuredOutputs._compile = broken
    try:
        eng.add_request("kids", req)
        outs = []
        while eng.has_unfinished_requests():
            outs.extend(o for o in eng.step() if o.finished)
    finally:
        StructuredOutputs._compile = real
    (out,) = outs
    assert len(out.outputs) == 3
    for o in out.outputs:
        assert o.finish_reason == "stop" and re.fullmatch(r"[a-z]{2,6}-[0-9]{2}", o.text), (o.finish_reason, o.text)


def test_slow_compiles_do_not_starve_the_others(smol):  # type: ignore[no-untyped-def]
    """Grammars that run past the timeout keep compiling in the background, but never hold up another
    one: a fast grammar after three slow ones still compiles, its timeout counted from its own start;
    the same slow grammar asked twice compiles once; past MAX_STRAGGLERS slow ones a new compile is
    refused at once (the compiler is busy) until they finish."""
    import threading
    import time

    from lmserve import structured as st_mod
    s = smol.engine.structured
    real = st_mod.StructuredOutputs._compile
    release = threading.Event()
    calls: list[str] = []

    def slow(self, compiler, kind, text):  # type: ignore[no-untyped-def]
        calls.append(text)
        if text.startswith("slow"):
            release.wait(30)
        return real(self, compiler, kind, text)

    saved = s.compile_timeout
    st_mod.StructuredOutputs._compile = slow
    try:
        s.compile_timeout = 0.5
        for i in range(st_mod.MAX_STRAGGLERS - 1):
            with pytest.raises(ValueError, match="took longer than"):
                s.compile(StructuredOutputsParams(regex=f"slow{i}[0-9]"))
        assert s.compile(StructuredOutputsParams(regex="fast[0-9]{3}")) is not None  # not queued behind them
        with pytest.raises(ValueError, match="took longer than"):
            s.compile(StructuredOutputsParams(regex="slow0[0-9]"))  # the same one again: waits on the first
        assert calls.count("slow0[0-9]") == 1
        with pytest.raises(ValueError, match="took longer than"):
            s.compile(StructuredOutputsParams(regex="slowlast[0-9]"))
        assert s.num_stragglers == st_mod.MAX_STRAGGLERS
        t0 = time.perf_counter()
        with pytest.raises(ValueError, match="busy"):
            s.compile(StructuredOutputsParams(regex="slowest[0-9]"))
        assert time.perf_counter() - t0 < 0.4  # refused at once, not after the timeout
        release.set()
        deadline = time.time() + 10
        while s.num_stragglers and time.time() < deadline:
            time.sleep(0.05)
        assert s.num_stragglers == 0
        assert s.compile(StructuredOutputsParams(regex="slowest[0-9]")) is not None  # free again
    finally:
        release.set()
        s.compile_timeout = saved
        st_mod.StructuredOutputs._compile = real


def test_compiles_in_flight_are_capped(smol, monkeypatch):  # type: ignore[no-untyped-def]
    """At most MAX_COMPILING distinct grammars compile at once: past that a new one is refused at once
    as busy (before, every distinct grammar started a thread, and its waiter held a worker thread for
    the whole timeout), while one already compiling is still waited on."""
    import threading
    import time

    from lmserve import structured as st_mod
    s = smol.engine.structured
    real = st_mod.StructuredOutputs._compile
    release = threading.Event()

    def slow(self, compiler, kind, text):  # type: ignore[no-untyped-def]
        if text.startswith("held"):
            release.wait(30)
        return real(self, compiler, kind, text)

    monkeypatch.setattr(st_mod.StructuredOutputs, "_compile", slow)
    monkeypatch.setattr(st_mod, "MAX_COMPILING", 2)
    results: dict = {}
    threads = [threading.Thread(target=lambda i=i: results.setdefault(i, s.compile(
        StructuredOutputsParams(regex=f"held{i}[0-9]")))) for i in range(2)]
    for t in threads:
        t.start()
    for _ in range(100):
        if len(s._inflight) == 2:
            break
        time.sleep(0.01)
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match="busy"):
        s.compile(StructuredOutputsParams(regex="other[0-9]"))
    assert time.perf_counter() - t0 < 0.5
    release.set()
    for t in threads:
        t.join(30)
    assert len(results) == 2 and s.compile(StructuredOutputsParams(regex="other[0-9]")) is not None


def test_a_finished_compile_no_longer_counts_as_compiling(smol, monkeypatch):  # type: ignore[no-untyped-def]
    """When a compile's waiters hear its outcome (a grammar, or a refusal), it is already out of the
    in-flight count (before, the thread left it there a moment longer: a waiter's next compiles found
    finished ones counted, and in a loaded CI run eight of them refused a compile as busy)."""
    from lmserve import structured as st_mod
    s = smol.engine.structured
    seen: list[int] = []

    class Watched(st_mod.Future):  # type: ignore[misc,name-defined]
        def set_result(self, result):  # type: ignore[no-untyped-def]
            seen.append(len(s._inflight))
            super().set_result(result)

        def set_exception(self, exception):  # type: ignore[no-untyped-def]
            seen.append(len(s._inflight))
            super().set_exception(exception)

    monkeypatch.setattr(st_mod, "Future", Watched)
    assert s.compile(StructuredOutputsParams(regex="finished[0-9]{4}")) is not None
    with pytest.raises(ValueError, match="uniqueItems"):
        s.compile(StructuredOutputsParams(json={"type": "array", "uniqueItems": True, "items": {"type": "integer"}}))
    assert seen == [0, 0]


UNENFORCED_SCHEMAS = [  # (schema, the keyword named, a document xgrammar's grammar takes that breaks it)
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems", "[1, 1]"),
    ({"type": "array", "items": {"type": "integer"}, "contains": {"const": 5}}, "contains", "[1]"),
    ({"allOf": [{"type": "integer"}, {"minimum": 3}]}, "allOf", "1"),
    ({"type": "integer", "not": {"const": 3}}, "not", "3"),
    ({"type": "integer", "if": {"minimum": 5}, "then": {"multipleOf": 2}}, "if", "7"),
    ({"type": "number", "multipleOf": 0.5}, "multipleOf", "0.3"),
    ({"type": "string", "format": "date-time", "maxLength": 12}, "maxLength", '"2024-01-01T00:00:00Z"'),
    ({"type": "string", "pattern": "^a+$", "maxLength": 2}, "maxLength", '"aaaa"'),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "propertyNames": {"pattern": "^b"}},
     "propertyNames", '{"a": 1}'),
    ({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
      "dependentRequired": {"a": ["b"]}}, "dependentRequired", '{"a": 1}'),
    ({"$ref": "http://example.com/schema.json"}, "$ref", '"x"'),
    ({"type": "string", "pattern": "\\Aab"}, "pattern", '"Aab"'),  # a JSON schema's regex is screened too
    ({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
      "anyOf": [{"required": ["a"]}, {"required": ["b"]}]}, "required", "{}"),  # a branch naming its parent's keys
]


@pytest.mark.parametrize("schema, keyword, breaks", UNENFORCED_SCHEMAS)
def test_a_schema_the_grammar_engine_would_not_enforce_is_refused(smol, schema, keyword, breaks):  # type: ignore[no-untyped-def]
    """Before, each was accepted and its outputs broke it (uniqueItems gave [1, 2, 3, 2], finish_reason
    stop). The third column is why: a document xgrammar's own grammar for the schema takes, which the
    independent validator (jsonschema) refuses; nested, the refusal names the path."""
    jsonschema = pytest.importorskip("jsonschema")
    from xgrammar.testing import _is_grammar_accept_string
    if keyword != "$ref":  # (jsonschema would fetch the URL)
        assert _is_grammar_accept_string(xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False), breaks)
        assert not jsonschema.Draft202012Validator(schema).is_valid(json.loads(breaks))
    for constraint, field in ((schema, "structured_outputs.json"),
                              ({"type": "object", "properties": {"x": schema}}, "structured_outputs.json: properties.x.")):
        with pytest.raises(ValueError, match=re.escape(field) + ".*" + re.escape(keyword)):
            smol.generate(["hi"], greedy(4, json=constraint), use_tqdm=False)
    assert smol.stats().used_blocks == 0


def test_schemas_the_grammar_engine_enforces_are_taken(smol):  # type: ignore[no-untyped-def]
    """The screen refuses only what is not enforced: the same keywords in the forms xgrammar keeps."""
    jsonschema = pytest.importorskip("jsonschema")
    ok = [{"type": "array", "items": {"type": "integer"}, "uniqueItems": False, "maxItems": 2},
          {"allOf": [{"type": "integer", "minimum": 3, "maximum": 9}]}, {"type": "integer", "multipleOf": 3,
                                                                          "minimum": 1, "maximum": 20},
          {"type": "string", "format": "date"}, {"type": "string", "pattern": "^[ab]{2}$"},
          {"$defs": {"n": {"type": "integer", "minimum": 0, "maximum": 5}}, "type": "object",
           "properties": {"not": {"$ref": "#/$defs/n"}}, "required": ["not"], "additionalProperties": False},
          # (a review found these refused: a nullable integer's multipleOf, constraints that constrain nothing)
          {"type": ["integer", "null"], "multipleOf": 2, "minimum": 0, "maximum": 9},
          {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["a"],
           "unevaluatedProperties": True, "dependentRequired": {}},
          {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 2, "minContains": 1}]
    outs = smol.generate(["Some JSON:"] * len(ok), [greedy(40, json=s) for s in ok], use_tqdm=False)
    for schema, o in zip(ok, outs):
        assert o.outputs[0].finish_reason == "stop", (schema, o.outputs[0].text)
        jsonschema.validate(json.loads(o.outputs[0].text), schema)


@pytest.mark.parametrize("regex", [r"\Aab\Z", r"ab\z", r"a\Gb", r"x\Qy"])
def test_a_regex_escape_the_grammar_engine_reads_as_a_letter_is_refused(smol, regex):  # type: ignore[no-untyped-def]
    """xgrammar matches \\A as the letter A (an output 'AabZ' for \\Aab\\Z, which re.fullmatch refuses);
    an escaped backslash before a letter is a literal and stays allowed."""
    from xgrammar.testing import _is_grammar_accept_string
    letter = regex[regex.index("\\") + 1]
    with pytest.raises(ValueError, match=r"structured_outputs.regex: \\" + letter):
        smol.generate(["hi"], greedy(4, regex=regex), use_tqdm=False)
    assert _is_grammar_accept_string(xgr.Grammar.from_regex(r"\Aab"), "Aab") and not re.fullmatch(r"\Aab", "Aab")
    assert smol.generate(["hi"], greedy(4, regex=r"\\A[0-9]"), use_tqdm=False)[0].outputs[0].text[:2] == "\\A"
    assert smol.generate(["hi"], greedy(8, regex=r"\U0001F600"), use_tqdm=False)[0].outputs[0].text == "\U0001F600"


def test_a_schema_that_is_not_json_is_a_value_error():  # type: ignore[no-untyped-def]
    """A Python schema json cannot write (a set, bytes) named its field with a ValueError (a TypeError before)."""
    for schema in ({"type": "string", "enum": {"a", "b"}}, {"type": "string", "default": b"x"}):
        with pytest.raises(ValueError, match="structured_outputs.json"):
            SamplingParams(structured_outputs=StructuredOutputsParams(json=schema))


def test_a_compile_past_its_timeout_does_not_abort_the_exit(tmp_path):  # type: ignore[no-untyped-def]
    """A compile refused for its time goes on in the background; the process still exits cleanly (its
    daemon thread was killed inside xgrammar's C++ at exit: 'terminate called', rc 134)."""
    import subprocess
    import sys
    script = tmp_path / "run.py"
    script.write_text(
        "from lmserve import LLM, SamplingParams, StructuredOutputsParams as SO\n"
        "llm = LLM(grammar_compile_timeout=0.05)\n"
        "try:\n"
        "    llm.generate(['Hi'], SamplingParams(max_tokens=4, structured_outputs=SO(regex='[a-z]{0,300}x')),"
        " use_tqdm=False)\n"
        "except ValueError as e:\n"
        "    print('refused', e)\n")
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "refused structured_outputs.regex: took longer" in r.stdout, (r.returncode, r.stderr[-500:])


def test_server_names_the_constraint_as_sent_and_answers_busy_with_429(smol, monkeypatch):  # type: ignore[no-untyped-def]
    """A constraint's 400 names the field the client used (it named structured_outputs.json for a
    response_format, a guided_json or a tools schema; a lone surrogate in guided_regex gave no field);
    a compiler at its limit is a 429 with Retry-After, not a 400 (a client does not retry a 400)."""
    from starlette.testclient import TestClient

    from lmserve import structured as st_mod
    from lmserve.server.app import build_app
    from lmserve.server.async_engine import AsyncEngine
    bad = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a": bad}}}}
    cases = [({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": bad}}},
              "response_format.json_schema.schema"), ({"guided_json": bad}, "guided_json"),
             ({"guided_regex": r"\Aab"}, "guided_regex"), ({"structured_outputs": {"json": bad}},
                                                           "structured_outputs.json"),
             ({"tools": [tool], "tool_choice": "required"}, "tools[0].function.parameters")]
    with TestClient(build_app(AsyncEngine(smol.engine), "smollm2-135m")) as c:
        def chat(extra: dict) -> object:
            body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, **extra}
            return c.post("/v1/chat/completions", json=body)
        for extra, param in cases:
            r = chat(extra)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (param, r.text)
            assert "$defs" not in r.json()["error"]["message"], r.text  # (a forced tool's named as sent)
        r = chat({"tools": [{"type": "function", "function": {"name": "g"}}, tool],
                  "tool_choice": {"type": "function", "function": {"name": "f"}}})
        assert r.json()["error"]["message"] == "tools[1].function.parameters: properties.a.uniqueItems is not " \
            "enforced by the grammar engine", r.text
        raw = b'{"messages": [{"role": "user", "content": "Hi"}], "guided_regex": "\\ud800"}'
        r = c.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "guided_regex", r.text
        r = c.post("/v1/responses", json={"input": "hi", "max_output_tokens": 4, "text": {
            "format": {"type": "json_schema", "name": "x", "schema": bad}}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "text.format.schema", r.text

        def busy(self, spec):  # type: ignore[no-untyped-def]
            raise st_mod.CompilerBusy("structured_outputs.regex: the grammar compiler is busy; try again later")
        monkeypatch.setattr(st_mod.StructuredOutputs, "compile", busy)
        r = chat({"guided_regex": "[0-9]+"})
        assert r.status_code == 429 and r.headers["retry-after"] == "1" and "busy" in r.json()["error"]["message"]
        r = c.post("/v1/responses", json={"input": "hi", "max_output_tokens": 4, "text": {
            "format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}}})
        assert r.status_code == 429 and r.json()["error"]["message"].startswith("text.format.schema:"), r.text


def test_a_constraint_the_vocabulary_cannot_write_is_a_400(smol):  # type: ignore[no-untyped-def]
    """SmolLM2's byte-level vocabulary has no token for the byte 0xF1, so U+42221 cannot be written: the
    grammar allows no token at all. The request ends with an error saying so, which the server answers
    as a 400 (found by schemathesis: it was a 500, 'the model produced a token its grammar does not
    allow', after the sampler picked from an all -inf row); the request beside it is unaffected."""
    from starlette.testclient import TestClient

    from lmserve.server.app import build_app
    from lmserve.server.async_engine import AsyncEngine
    tok = smol.tokenizer
    assert tok.decode(tok.encode("\U00042221", add_special_tokens=False)) != "\U00042221"  # the premise
    bad, ok = smol.generate(["Hi", "Hi"], [greedy(8, choice=["\U00042221"]), greedy(8, choice=["yes"])], use_tqdm=False)
    assert bad.outputs[0].finish_reason == "error" and "can continue the constraint" in bad.outputs[0].error
    assert ok.outputs[0].text == "yes" and smol.stats().used_blocks == 0
    with TestClient(build_app(AsyncEngine(smol.engine), "smollm2-135m")) as c:
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8,
                                                  "guided_choice": ["\U00042221"]})
        assert r.status_code == 400 and "can continue the constraint" in r.json()["error"]["message"], r.text
