"""Engine behaviour on the real default model: bad input, stop strings, detokenization, chat, streaming."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lmserve import LLM, SamplingParams
from lmserve.sequence import SamplingParams as SP
from lmserve.detokenizer import IncrementalDetokenizer

GOOD = SamplingParams(max_tokens=4, temperature=0)


def serves_good_request(llm: LLM) -> None:
    out = llm.generate(["The capital of France is"], GOOD, use_tqdm=False)[0]
    assert out.finished and len(out.outputs[0].token_ids) >= 1
    st = llm.stats()
    assert st.num_running == 0 and st.num_waiting == 0 and st.used_blocks == 0


def changed(**kw):  # type: ignore[no-untyped-def]
    """Valid SamplingParams changed afterwards (a dataclass allows it): only the engine can catch it."""
    p = SP(max_tokens=4)
    for k, v in kw.items():
        setattr(p, k, v)
    return p


@pytest.mark.parametrize("field,make", [
    ("prompt", lambda llm: llm.generate([""], GOOD)),
    ("prompt", lambda llm: llm.generate([[]], GOOD)),
    ("prompt_token_ids", lambda llm: llm.generate([[1, 2, 49152]], GOOD)),
    ("prompt_token_ids", lambda llm: llm.generate([[1, -5]], GOOD)),
    ("prompt", lambda llm: llm.generate([[5] * 8192], GOOD)),
    ("max_tokens", lambda llm: llm.generate(["hi"], SamplingParams(max_tokens=8192))),
    ("max_tokens", lambda llm: llm.generate(["hi"], changed(max_tokens=0))),
    ("temperature", lambda llm: llm.generate(["hi"], changed(temperature=-0.5))),
    ("temperature", lambda llm: llm.generate(["hi"], changed(temperature=float("nan")))),
    ("top_p", lambda llm: llm.generate(["hi"], changed(top_p=0.0))),
    ("top_p", lambda llm: llm.generate(["hi"], changed(top_p=1.5))),
    ("top_k", lambda llm: llm.generate(["hi"], changed(top_k=-3))),
    ("logit_bias", lambda llm: llm.generate(["hi"], SP(logit_bias={99999: 1.0}))),
    ("stop_token_ids", lambda llm: llm.generate(["hi"], SP(stop_token_ids=[-1]))),
    ("logprobs", lambda llm: llm.generate(["hi"], changed(logprobs=50))),
    ("params", lambda llm: llm.engine.add_request("x", "hi", {"max_tokens": 4})),  # type: ignore[arg-type]
])
def test_bad_input_raises_and_engine_survives(smol, field, make):  # type: ignore[no-untyped-def]
    """Every row reaches the engine (the first bad field is named) and leaves it serving."""
    with pytest.raises(ValueError, match=field):
        make(smol)
    assert not smol.engine.has_unfinished_requests()
    serves_good_request(smol)


@pytest.mark.parametrize("field,kw", [("max_tokens", dict(max_tokens=0)), ("temperature", dict(temperature=-0.5)),
                                      ("temperature", dict(temperature=float("inf"))),
                                      ("top_p", dict(top_p=0.0)), ("top_k", dict(top_k=-3)),
                                      ("logprobs", dict(logprobs=-1)), ("min_p", dict(min_p=float("nan"))),
                                      # a bool is an int to Python: it must not pass for a count or an id
                                      ("logprobs", dict(logprobs=True)), ("n", dict(n=True)), ("top_k", dict(top_k=True)),
                                      ("seed", dict(seed=True)), ("seed", dict(seed=-(2 ** 63) - 1)),
                                      ("min_tokens", dict(min_tokens=True)),
                                      ("stop_token_ids", dict(stop_token_ids=["a"])), ("stop_token_ids", dict(stop_token_ids=5)),
                                      ("stop_token_ids", dict(stop_token_ids=[1.5])), ("stop", dict(stop=5)),
                                      ("logit_bias", dict(logit_bias={1.7: 1})),
                                      *[("truncate_prompt_tokens", dict(truncate_prompt_tokens=v)) for v in (0, -2, True, 2.0)],
                                      # beam search ranks raw log-probs: what it would ignore is refused
                                      *[(f, dict(use_beam_search=True, n=2, **{f: v})) for f, v in (
                                          ("logit_bias", {3: 5.0}), ("repetition_penalty", 1.3),
                                          ("presence_penalty", 0.5), ("frequency_penalty", 0.5), ("min_tokens", 2),
                                          ("stop", ["x"]), ("logprobs", 2), ("prompt_logprobs", 1))]])
def test_sampling_params_name_the_bad_field(field, kw):  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match=field):
        SP(**kw)


def test_truncate_prompt_tokens(tiny_models, tmp_path):  # type: ignore[no-untyped-def]
    """vLLM's truncate_prompt_tokens: the last k tokens run, as the same k sent alone (greedy tokens and
    logprobs equal); a text prompt keeps the BOS its tokenization put first, within the k (HF's
    truncation keeps special tokens), and the output its text; -1 is the context length (vLLM's meaning),
    which leaves no room to generate after a prompt that long: refused by name, as is more than the context."""
    from tokenizers import Tokenizer, processors

    from tests.conftest import char_tokenizer_model
    path = char_tokenizer_model(tiny_models["llama"][0], tmp_path / "bos")
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))  # characters, and a BOS (id 1) first
    tok.post_processor = processors.TemplateProcessing(single="\x01 $A", special_tokens=[("\x01", 1)])
    tok.save(str(path / "tokenizer.json"))
    llm = LLM(str(path), max_model_len=64)
    text = "hello world, this is long"
    out = llm.generate([text], SamplingParams(max_tokens=2, truncate_prompt_tokens=5), use_tqdm=False)[0]
    assert out.prompt_token_ids == [1] + [ord(ch) for ch in "long"] and out.prompt == text
    out = llm.generate([text], SamplingParams(max_tokens=2, truncate_prompt_tokens=1), use_tqdm=False)[0]
    assert out.prompt_token_ids == [1]
    prompt = [(7 * i) % 120 + 3 for i in range(50)]
    p = SamplingParams(max_tokens=5, temperature=0, logprobs=1, ignore_eos=True)
    cut, alone = (llm.generate([x], q, use_tqdm=False)[0] for x, q in (
        (prompt, dataclasses.replace(p, truncate_prompt_tokens=11)), (prompt[-11:], p)))
    assert cut.prompt_token_ids == prompt[-11:] and cut.outputs[0].token_ids == alone.outputs[0].token_ids
    assert [x.logprob for x in cut.outputs[0].logprobs] == [x.logprob for x in alone.outputs[0].logprobs]
    long = prompt + prompt  # 100 tokens in a 64-token context: -1 keeps 64, which leaves no room to generate
    with pytest.raises(ValueError, match="truncate_prompt_tokens: keeping 64 tokens fills the model's context"):
        llm.generate([long], SamplingParams(max_tokens=1, truncate_prompt_tokens=-1), use_tqdm=False)
    out = llm.generate([long], SamplingParams(max_tokens=4, truncate_prompt_tokens=60), use_tqdm=False)[0]
    assert out.prompt_token_ids == long[-60:] and len(out.outputs[0].token_ids) == 4
    with pytest.raises(ValueError, match="truncate_prompt_tokens: 65 is more than the model's context"):
        llm.generate([prompt], SamplingParams(truncate_prompt_tokens=65), use_tqdm=False)


def test_max_logprobs(tiny_models):  # type: ignore[no-untyped-def]
    """vLLM's max_logprobs: 20 by default (more is refused by the engine, naming the field); raised, a
    request gets that many alternatives, the model's own top-k in float64; -1 allows the vocabulary."""
    path = str(tiny_models["llama"][0])
    prompt = [5, 17, 33, 9, 100, 3]
    with pytest.raises(ValueError, match=r"logprobs: at most 20 \(the engine's max_logprobs\), got 21"):
        LLM(path).generate([prompt], SamplingParams(max_tokens=1, logprobs=21), use_tqdm=False)
    llm = LLM(path, max_logprobs=-1)
    out = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0, logprobs=128, prompt_logprobs=40),
                       use_tqdm=False)[0]
    ref = torch.log_softmax(llm.score(prompt).double(), -1)  # (6, 128): each position's next-token log-probs
    last = out.outputs[0].logprobs[0].top
    assert len(last) == 128 and max(abs(v - ref[-1, t].item()) for t, v in last.items()) < 1e-4
    top = out.prompt_logprobs[3].top  # prompt token 3's: the 40 likeliest after tokens 0..2
    assert set(top) == set(ref[2].topk(40).indices.tolist()) and len(top) == 40
    with pytest.raises(ValueError, match="prompt_logprobs: at most 128"):
        llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=129), use_tqdm=False)
    with pytest.raises(ValueError, match="max_logprobs"):
        LLM(path, max_logprobs=-2)


def test_numpy_integers_are_token_ids():  # type: ignore[no-untyped-def]
    """numpy's integers pass for counts and seeds; they pass for token ids too, stored as ints."""
    np = pytest.importorskip("numpy")
    p = SP(stop_token_ids=[np.int64(7)], logit_bias={np.int32(3): 1.0}, max_tokens=np.int64(4))
    assert p.stop_token_ids == [7] and type(p.stop_token_ids[0]) is int
    assert p.logit_bias == {3: 1.0} and type(next(iter(p.logit_bias))) is int


def test_score_refuses_a_prompt_past_max_model_len(tiny_models):  # type: ignore[no-untyped-def]
    """LLM.score checked no length: past max_model_len it scored anyway, past the rotary table it was an
    IndexError (on CUDA a device-side assert that poisons the context)."""
    llm = LLM(str(tiny_models["llama"][0]), max_model_len=64)
    assert llm.score(list(range(3, 67))).shape == (64, 128)
    for n in (65, 3000):
        with pytest.raises(ValueError, match=f"prompt: {n} tokens, past max_model_len \\(64\\)"):
            llm.score([5] * n)


def test_bad_request_in_a_batch_runs_nothing(smol):  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match="prompt_token_ids"):
        smol.generate(["fine", [1, 10**9]], GOOD)
    assert not smol.engine.has_unfinished_requests()
    serves_good_request(smol)


def test_duplicate_request_id_and_abort(smol):  # type: ignore[no-untyped-def]
    eng = smol.engine
    eng.add_request("dup", "Hello", SamplingParams(max_tokens=50, temperature=0))
    with pytest.raises(ValueError, match="request_id"):
        eng.add_request("dup", "Hello again", GOOD)
    eng.step()
    assert eng.stats().used_blocks > 0
    assert eng.abort_request("dup")
    assert eng.stats().used_blocks == 0 and not eng.has_unfinished_requests()
    assert not eng.abort_request("dup")
    serves_good_request(smol)


def test_unknown_model_path():
    with pytest.raises(FileNotFoundError, match="model"):
        LLM("/nonexistent/model/dir")


def test_the_token_that_ends_a_sequence_gives_no_text(smol):  # type: ignore[no-untyped-def]
    """As vLLM: the EOS or stop_token_ids token that ended a sequence stays in token_ids but its text is
    not output text unless include_stop_str_in_output (before, a stop token's text and, with
    skip_special_tokens false, '<|im_end|>' ended the text)."""
    tok = smol.tokenizer
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Count from 1 to 5."}]),
                        add_special_tokens=False)
    free = smol.generate([prompt], SamplingParams(max_tokens=12, temperature=0), use_tqdm=False)[0].outputs[0]
    k = next(i for i in range(2, 12) if free.token_ids[i] not in free.token_ids[:i])  # its first appearance
    stop_id = free.token_ids[k]
    for keep in (False, True):
        out = smol.generate([prompt], SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[stop_id],
                                                     include_stop_str_in_output=keep), use_tqdm=False)[0].outputs[0]
        assert out.finish_reason == "stop" and out.stop_reason == stop_id and out.token_ids == free.token_ids[:k + 1]
        assert out.text == tok.decode(out.token_ids if keep else out.token_ids[:-1])
    chat = smol.generate([prompt], SamplingParams(max_tokens=200, temperature=0, skip_special_tokens=False),
                         use_tqdm=False)[0].outputs[0]
    assert chat.finish_reason == "stop" and chat.token_ids[-1] in tok.eos_token_ids
    assert chat.text == tok.decode(chat.token_ids[:-1], skip_special_tokens=False)
    assert tok.eos_token not in chat.text


def test_stop_string_is_not_emitted(smol):  # type: ignore[no-untyped-def]
    free = smol.generate(["The capital of France is"], SamplingParams(max_tokens=12, temperature=0),
                         use_tqdm=False)[0].outputs[0].text
    words = free.split()
    stop = words[1]  # a word that appears after the first one
    out = smol.generate(["The capital of France is"], SamplingParams(max_tokens=12, temperature=0, stop=[stop]),
                        use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert stop not in out.text and free.startswith(out.text)
    keep = smol.generate(["The capital of France is"],
                         SamplingParams(max_tokens=12, temperature=0, stop=[stop], include_stop_str_in_output=True),
                         use_tqdm=False)[0].outputs[0]
    assert keep.text == out.text + stop


def test_streaming_deltas_join_to_text(smol):  # type: ignore[no-untyped-def]
    eng = smol.engine
    params = SamplingParams(max_tokens=30, temperature=0.8, seed=3, stop=["\n\n"])
    eng.add_request("s1", "Write a list of three fruits:", params)
    deltas, final = [], None
    while eng.has_unfinished_requests():
        for out in eng.step():
            deltas.append(out.outputs[0].delta_text)
            final = out
    assert final is not None and final.finished
    assert "".join(deltas) == final.outputs[0].text
    again = smol.generate(["Write a list of three fruits:"], params, use_tqdm=False)[0]
    assert again.outputs[0].text == final.outputs[0].text  # same seed, same text


def test_a_negative_seed_is_its_own_seed(smol):  # type: ignore[no-untyped-def]
    """vLLM takes any signed 64-bit seed (it was refused). -2 is not 2 (random.Random seeds by the
    absolute value: taken modulo 2**64 first) and repeats itself. (-1 is vLLM's "no seed":
    test_sampling.py.)"""
    def text(seed: int) -> str:
        p = SamplingParams(max_tokens=24, temperature=1.0, seed=seed, ignore_eos=True)
        return smol.generate(["Once upon a time"], p, use_tqdm=False)[0].outputs[0].text

    minus = text(-2)
    assert minus == text(-2) and minus != text(2)
    assert text(-(2 ** 63)) == text(2 ** 63)  # the same seed modulo 2**64


def test_incremental_detokenizer_never_splits_utf8(smol):  # type: ignore[no-untyped-def]
    tok = smol.tokenizer
    text = "日本語のテキスト 🙂🚀 héllo wörld — ½ ∑"
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok, [1, 2, 3])
    pieces = [detok.step([i]) for i in ids]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == tok.decode(ids) == text
    assert any(p == "" for p in pieces)  # some tokens are partial characters, held back


def test_chat_and_metrics(smol):  # type: ignore[no-untyped-def]
    out = smol.chat([{"role": "user", "content": "What is 2+2?"}], SamplingParams(max_tokens=24, temperature=0))[0]
    assert "4" in out.outputs[0].text
    m = out.metrics
    assert m.ttft is not None and m.ttft > 0 and m.e2e >= m.ttft
    assert m.num_output_tokens == len(out.outputs[0].token_ids)
    if m.num_output_tokens > 1:
        assert m.tpot is not None and m.tpot > 0


def test_kv_budget_from_profile():
    from lmserve.runner import kv_budget_from_profile
    gib = 2**30
    # 141 GiB device at 0.9, a profiled peak of 3 GiB of which 0.5 GiB was the scratch cache
    assert kv_budget_from_profile(141 * gib, 0.9, 3 * gib, gib // 2) == int(141 * gib * 0.9) - (3 * gib - gib // 2)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        kv_budget_from_profile(10 * gib, 0.1, 2 * gib, 0)


def test_cpu_default_kv_budget(smol):  # type: ignore[no-untyped-def]
    assert smol.engine.kv_budget == 2**30  # 1 GiB on the CPU unless given
    st = smol.stats()
    assert st.kv_capacity_tokens == st.num_blocks * st.block_size == (2**30 // (46080 * 16)) * 16


def byte_tokens(tok, data: bytes) -> list[int]:  # type: ignore[no-untyped-def]
    """One byte-level BPE token per byte (GPT-2's byte -> printable character map)."""
    ids = {tok.raw.token_to_id(ch): b for ch, b in _BYTE_OF.items()}
    table = {b: i for i, b in ids.items() if i is not None}
    return [table[b] for b in data]


def _byte_map() -> dict[str, int]:
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


_BYTE_OF = _byte_map()


def test_detokenizer_prompt_cut_inside_a_character(smol):  # type: ignore[no-untyped-def]
    """Defect 5: a prompt given as token ids that ends inside a UTF-8 character (its text ends in
    U+FFFD) made every later delta empty. Cut emoji and CJK at every byte boundary: the output text
    is what follows the prompt's last whole character, the completed character included, in deltas
    that never hold a replacement character."""
    tok = smol.tokenizer
    text = "ok 日本🙂語 ½"
    data = text.encode()
    ids = byte_tokens(tok, data)
    assert tok.decode(ids) == text
    lead = tok.encode("Say:", add_special_tokens=False)
    for k in range(1, len(ids)):
        prompt = lead + ids[:k]
        expected = text[len(data[:k].decode("utf-8", "ignore")):]
        detok = IncrementalDetokenizer(tok, prompt)
        pieces = [detok.step([i]) for i in ids[k:]]
        assert "".join(pieces) == expected, k
        assert not any("\ufffd" in p for p in pieces), k


def test_generation_after_a_prompt_cut_inside_a_character(smol):  # type: ignore[no-untyped-def]
    """The engine path of defect 5: text, and stop strings that match it."""
    tok = smol.tokenizer
    cut = tok.encode("Translate to English: 日本", add_special_tokens=False) + byte_tokens(tok, "語".encode())[:2]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    out = smol.generate([cut], params, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 12
    stable = tok.decode(cut).rstrip("\ufffd")
    assert out.text and out.text == tok.decode(cut + out.token_ids)[len(stable):].rstrip("\ufffd")
    stop = out.text.strip()[:3]
    stopped = smol.generate([cut], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, stop=[stop]),
                            use_tqdm=False)[0].outputs[0]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop and stop not in stopped.text


def test_llm_rejects_unknown_options():
    with pytest.raises(TypeError, match="max_num_seq"):
        LLM("smollm2-135m", max_num_seq=8)  # a typo of max_num_seqs: refused before any loading


@pytest.mark.parametrize("value,expected", [("512B", 512), ("2GiB", 2 * 2**30), ("1.5KiB", 1536), ("1e9B", 10**9),
                                            ("500MB", 500 * 10**6), (4096, 4096), (2e9, 2 * 10**9)])
def test_kv_cache_memory_units_are_exact(value, expected):  # type: ignore[no-untyped-def]
    from lmserve.config import parse_bytes
    assert parse_bytes(value) == expected


@pytest.mark.parametrize("value", ["2", "512", "1 parsec", "0B", "0.5B", -1, True])
def test_kv_cache_memory_without_a_unit_is_refused(value):  # type: ignore[no-untyped-def]
    from lmserve.config import EngineConfig
    with pytest.raises(ValueError, match="kv_cache_memory"):
        EngineConfig(kv_cache_memory=value)


@pytest.mark.parametrize("field,kw", [("swap_space", dict(swap_space=-5)), ("swap_space", dict(swap_space="2")),
                                      ("ngram_min", dict(ngram_min=0)), ("ngram_max", dict(ngram_min=3, ngram_max=2)),
                                      ("spec_max_batch", dict(spec_max_batch=-1)),  # (0: never speculate, a use)
                                      ("spec_min_acceptance", dict(spec_min_acceptance=-3)),
                                      ("draft_num_layers", dict(draft_num_layers=-2)),
                                      ("max_num_seqs", dict(max_num_seqs=2.5)), ("block_size", dict(block_size=True)),
                                      ("num_speculative_tokens", dict(num_speculative_tokens=0))])
def test_engine_config_names_the_bad_field(field, kw):  # type: ignore[no-untyped-def]
    """Each was accepted (an engine built with max_num_seqs 2.5), or refused naming another field
    (swap_space's errors said kv_cache_memory)."""
    from lmserve.config import EngineConfig
    with pytest.raises(ValueError, match=f"^{field}"):
        EngineConfig(**kw)


def test_a_context_past_the_models_is_refused(tiny_models):  # type: ignore[no-untyped-def]
    """max_model_len above the model's max_position_embeddings (2048): an error naming it, as vLLM
    gives (before, silently cut to 2048)."""
    path, _ = tiny_models["llama"]
    with pytest.raises(ValueError, match="max_model_len.*2048"):
        LLM(str(path), max_model_len=10**6, kv_cache_memory="16MiB")
    assert LLM(str(path), max_model_len=2048, kv_cache_memory="16MiB").engine.max_model_len == 2048


def test_stop_strings_need_a_tokenizer(tiny_models):  # type: ignore[no-untyped-def]
    path, _ = tiny_models["llama"]
    llm = LLM(str(path), kv_cache_memory="16MiB")
    assert llm.tokenizer is None
    with pytest.raises(ValueError, match="stop"):
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, stop=["x"]), use_tqdm=False)
    assert len(llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)[0]
               .outputs[0].token_ids) == 4


def test_a_dropped_engine_is_freed_at_once(tiny_models):  # type: ignore[no-untyped-def]
    """No reference cycle through the engine (its parts hold no bound methods of it), so dropping an
    LLM frees its KV cache at once, not at some later GC pass: a test suite (or a process that
    reloads models) would otherwise hold one dead cache per engine, a GiB each by default."""
    import gc
    import weakref
    path, _ = tiny_models["llama"]
    gc.disable()
    try:
        for kw in ({}, {"speculative_method": "draft", "draft_num_layers": 1}):
            llm = LLM(str(path), kv_cache_memory="16MiB", **kw)
            llm.generate([[1, 2, 3, 1, 2, 3]], SamplingParams(max_tokens=4, n=2), use_tqdm=False)
            llm.generate([[4, 5, 6]], SamplingParams(max_tokens=3, use_beam_search=True, best_of=2), use_tqdm=False)
            ref = weakref.ref(llm.engine.kv_cache)
            del llm
            assert ref() is None, kw
    finally:
        gc.enable()


def test_stop_strings_wait_for_min_tokens(smol):  # type: ignore[no-untyped-def]
    """A stop string in the first token, min_tokens 6: like a stop token, it counts only from the 7th
    token on (vLLM's rule); before, the output ended at its first token while stop_token_ids waited."""
    free = smol.generate(["The capital of France is"], SamplingParams(max_tokens=12, temperature=0),
                         use_tqdm=False)[0].outputs[0]
    stop = free.text[:2]  # in the first token's text
    first = smol.generate(["The capital of France is"], SamplingParams(max_tokens=12, temperature=0, stop=stop),
                          use_tqdm=False)[0].outputs[0]
    assert first.finish_reason == "stop" and len(first.token_ids) == 1
    held = smol.generate(["The capital of France is"], SamplingParams(max_tokens=12, temperature=0, stop=stop,
                                                                      min_tokens=6), use_tqdm=False)[0].outputs[0]
    assert len(held.token_ids) >= 7 and held.token_ids[:7] == free.token_ids[:7]


def test_token_bytes_join_to_the_texts_utf8(smol):  # type: ignore[no-untyped-def]
    """Byte-level BPE: every token's own bytes (a piece of a character included) joined are the text's
    UTF-8, special tokens too."""
    tok = smol.tokenizer
    for text in ("游让 🙂 héllo", "<|im_start|>user\n日本語<|im_end|>", "  tabs\tand\n\nspaces"):
        ids = tok.encode(text, add_special_tokens=False)
        assert b"".join(tok.token_bytes(t) for t in ids) == text.encode("utf-8"), text


def test_chat_takes_a_chat_template_by_vllms_name(smol):  # type: ignore[no-untyped-def]
    """LLM.chat(..., chat_template=...) renders that template (before, the keyword went into the model's own
    template as an unused variable)."""
    msgs = [{"role": "user", "content": "hi"}]
    out = smol.chat(msgs, SamplingParams(max_tokens=1, temperature=0),
                    chat_template="{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}")[0]
    assert out.prompt_token_ids == smol.tokenizer.encode("<<hi>>", add_special_tokens=False)


def test_generate_from_two_threads_and_from_inside_a_step(smol, monkeypatch):  # type: ignore[no-untyped-def]
    """Two threads' generate() calls on one LLM run one after the other, each with its own outputs (they
    interleaved steps: one thread waited forever, the other's step failed on an empty batch); a call
    from inside a running one is a RuntimeError, and the outer call still ends."""
    import threading
    sp = SamplingParams(max_tokens=6, temperature=0)
    prompts = ["Hello there", "The capital of France is"]
    ref = {p: smol.generate([p], sp, use_tqdm=False)[0].outputs[0].text for p in prompts}
    got: dict = {}
    go = threading.Barrier(2)

    def worker(p: str) -> None:
        go.wait()
        got[p] = [o.outputs[0].text for o in smol.generate([p] * 3, sp, use_tqdm=False)]

    threads = [threading.Thread(target=worker, args=(p,), daemon=True) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads) and got == {p: [ref[p]] * 3 for p in prompts}
    inner: list = []
    real = smol.engine.output.process

    def process(*a, **k):  # type: ignore[no-untyped-def]
        if not inner:
            try:
                smol.generate(["x"], sp, use_tqdm=False)
            except RuntimeError as e:
                inner.append(e)
        return real(*a, **k)

    monkeypatch.setattr(smol.engine.output, "process", process)
    out = smol.generate([prompts[0]], sp, use_tqdm=False)
    assert "from inside" in str(inner[0]) and out[0].outputs[0].text == ref[prompts[0]]
    assert not smol.engine.has_unfinished_requests()


def test_prompts_in_every_form(smol):  # type: ignore[no-untyped-def]
    """vLLM's {"prompt"} / {"prompt_token_ids"} dicts, alone or in a list (a lone dict generated for
    its key, the word 'prompt'), a tuple, a numpy array or a tensor of ids, numpy integers."""
    import numpy as np
    sp = SamplingParams(max_tokens=4, temperature=0)
    ref = smol.generate(["The capital of France is"], sp, use_tqdm=False)[0]
    ids = ref.prompt_token_ids
    for form in ({"prompt": "The capital of France is"}, [{"prompt_token_ids": ids}], tuple(ids), np.array(ids),
                 torch.tensor([ids]), [np.int64(t) for t in ids]):
        out = smol.generate(form, sp, use_tqdm=False)
        assert len(out) == 1 and out[0].prompt_token_ids == ids and out[0].outputs[0].text == ref.outputs[0].text
    for bad in ({"prompt": "x", "prompt_token_ids": [1]}, [{"text": "x"}]):
        with pytest.raises(ValueError, match=r"prompts\[0\]"):
            smol.generate(bad, sp, use_tqdm=False)


def test_requests_added_by_hand_keep_their_outputs(smol):  # type: ignore[no-untyped-def]
    """generate() while the engine holds a request added by hand is refused (that request's output was
    consumed and dropped inside the call); the request goes on and ends with its output."""
    eng = smol.engine
    eng.add_request("mine", "my own request", SamplingParams(max_tokens=3, temperature=0))
    with pytest.raises(RuntimeError, match="engine.add_request"):
        smol.generate(["x"], SamplingParams(max_tokens=2), use_tqdm=False)
    outs = []
    while eng.has_unfinished_requests():
        outs += [o for o in eng.step() if o.finished]
    assert [o.request_id for o in outs] == ["mine"] and len(outs[0].outputs[0].token_ids) == 3


def test_an_interrupted_generate_leaves_no_block_held(smol, monkeypatch):  # type: ignore[no-untyped-def]
    """Ctrl-C during the step after a fork (n = 3 children copying their parent's last block): the
    copies' pinned sources are let go with the aborted requests (2 blocks stayed held, nothing running)."""
    eng, calls = smol.engine, [0]
    real = eng.runner.execute

    def execute(out):  # type: ignore[no-untyped-def]
        calls[0] += 1
        if calls[0] == 2:
            raise KeyboardInterrupt
        return real(out)

    monkeypatch.setattr(eng.runner, "execute", execute)
    with pytest.raises(KeyboardInterrupt):
        smol.generate(["The quick brown fox jumps over the lazy dog. " * 3, "Once upon a time"],
                      SamplingParams(max_tokens=6, temperature=0.8, seed=1, n=3), use_tqdm=False)
    assert calls[0] == 2 and not eng.has_unfinished_requests()
    assert smol.stats().used_blocks == 0 and not eng.block_manager.pins


def test_a_request_id_must_be_a_string_and_a_device_a_device(smol):  # type: ignore[no-untyped-def]
    for rid in (None, 7, ("a", 1)):
        with pytest.raises(TypeError, match="request_id"):
            smol.engine.add_request(rid, "Hi", SamplingParams(max_tokens=2))
    assert not smol.engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="device"):
        LLM(device="tpu")


def test_generate_interrupted_while_adding_queues_nothing(smol, monkeypatch):  # type: ignore[no-untyped-def]
    """Ctrl-C between two of generate()'s adds: the requests already added leave with it (they stayed
    queued, and every later generate() was refused as holding requests added by hand)."""
    real, calls = smol.engine.add_request, [0]

    def add(*a, **k):  # type: ignore[no-untyped-def]
        calls[0] += 1
        if calls[0] == 2:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(smol.engine, "add_request", add)
    with pytest.raises(KeyboardInterrupt):
        smol.generate(["a", "b", "c"], SamplingParams(max_tokens=2), use_tqdm=False)
    assert calls[0] == 2 and not smol.engine.has_unfinished_requests()


def test_reset_prefix_cache(tiny_models):  # type: ignore[no-untyped-def]
    """LLM.reset_prefix_cache (vLLM's): the same prompt again hits the cache before a reset and not after;
    refused (False, nothing forgotten) while a request added by hand holds blocks."""
    llm = LLM(str(tiny_models["llama"][0]), block_size=4)
    prompt, p = list(range(10, 50)), SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    llm.generate([prompt], p, use_tqdm=False)
    hits = llm.stats().prefix_hit_tokens
    llm.generate([prompt], p, use_tqdm=False)
    assert llm.stats().prefix_hit_tokens > hits and llm.stats().cached_blocks > 0
    hits = llm.stats().prefix_hit_tokens
    assert llm.reset_prefix_cache()
    llm.generate([prompt], p, use_tqdm=False)
    assert llm.stats().prefix_hit_tokens == hits  # computed again
    llm.engine.add_request("held", prompt, p)
    llm.engine.step()
    assert not llm.reset_prefix_cache()
    llm.engine.abort_request("held")
    hits = llm.stats().prefix_hit_tokens
    llm.generate([prompt], p, use_tqdm=False)
    assert llm.stats().prefix_hit_tokens > hits  # the cache survived the refused reset
