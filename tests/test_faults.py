"""Injected faults: a forward or sampler that raises for one step fails that step's requests alone
(finish_reason 'error', a 500 at the server) and the engine goes on; a reader that stops reading its
stream is cut off (its request aborted) instead of piling up outputs, and the others go on."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest

from lmserve import LLM, SamplingParams
from tests.conftest import FailOnCall

PROMPTS = [[5, 17, 33, 9, 100, 3], list(range(20, 61)), [11, 12], list(range(64, 100))]


def _run(eng, params):  # type: ignore[no-untyped-def]
    for i, p in enumerate(PROMPTS):
        eng.add_request(str(i), p, params)
    done = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out.outputs[0]
    return done


@pytest.mark.parametrize("where", ["forward", "sampler"])
def test_a_failing_step_fails_its_requests_alone(tiny_models, where):  # type: ignore[no-untyped-def]
    """Two requests run at a time (max_num_seqs 2): the third step raises inside the model's forward
    or the sampler. The two requests in it end with finish_reason 'error' and the exception's text;
    the two still waiting then run to the same tokens as in a clean run, and every block is free."""
    path, _ = tiny_models["llama"]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    clean = _run(LLM(str(path), max_num_seqs=2).engine, params)
    llm = LLM(str(path), max_num_seqs=2)
    eng = llm.engine
    if where == "forward":
        target, name = eng.runner, "forward"
    else:
        target, name = eng.runner, "sampler"
    setattr(target, name, FailOnCall(getattr(target, name), 3, RuntimeError(f"injected {where} fault")))
    done = _run(eng, params)
    failed = {rid for rid, c in done.items() if c.finish_reason == "error"}
    assert failed == {"0", "1"}, {rid: c.finish_reason for rid, c in done.items()}
    assert all(f"injected {where} fault" in done[rid].error for rid in failed)
    for rid in ("2", "3"):
        assert done[rid].finish_reason == "length" and done[rid].token_ids == clean[rid].token_ids
    st = llm.stats()
    assert st.used_blocks == 0 and st.free_blocks == st.num_blocks and not eng.requests


def test_a_reader_that_stops_reading_is_cut_off(tiny_models, monkeypatch):  # type: ignore[no-untyped-def]
    """A stream whose reader takes one output and then stops: once MAX_UNREAD outputs wait unread, its
    request is aborted and the reader gets SlowReaderError; a request read normally beside it
    finishes, and every block is free. (The reader read normally makes fewer outputs than the limit: on
    a loaded machine the event loop can fall a few outputs behind the engine thread, and a 30-output
    request under a limit of 4 was cut off once in CI.)"""
    from lmserve.server import async_engine as ae_mod
    monkeypatch.setattr(ae_mod, "MAX_UNREAD", 8)
    path, _ = tiny_models["llama"]
    llm = LLM(str(path))
    ae = ae_mod.AsyncEngine(llm.engine)
    ae.start()
    try:
        async def main():  # type: ignore[no-untyped-def]
            slow = ae.generate("slow", ae.process_request(PROMPTS[1], SamplingParams(max_tokens=200, ignore_eos=True)))
            first = await slow.__anext__()
            assert not first.finished
            fast = [o async for o in ae.generate("fast", ae.process_request(
                PROMPTS[0], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)))]
            assert fast[-1].finished and len(fast[-1].outputs[0].token_ids) == 6
            for _ in range(500):  # the slow reader still reads nothing: wait for its request to be cut off
                if "slow" not in llm.engine.requests:
                    break
                await asyncio.sleep(0.02)
            with pytest.raises(ae_mod.SlowReaderError):
                async for _ in slow:
                    pass
        asyncio.run(main())
        for _ in range(100):
            if not llm.engine.requests:
                break
            asyncio.run(asyncio.sleep(0.02))
        assert not llm.engine.requests
    finally:
        ae.shutdown()
    st = llm.stats()
    assert st.used_blocks == 0


@contextlib.contextmanager
def merging_server(tiny_models):  # type: ignore[no-untyped-def]
    """A tiny model's engine under a running AsyncEngine, with the server's route logic (OpenAIServer,
    no HTTP) over it: (llm, async engine, server); the engine loop stops at the end."""
    pytest.importorskip("fastapi")
    from lmserve.server.app import OpenAIServer
    from lmserve.server.async_engine import AsyncEngine
    path, _ = tiny_models["llama"]
    llm = LLM(str(path))
    ae = AsyncEngine(llm.engine)
    ae.start()
    try:
        yield llm, ae, OpenAIServer(ae, "tiny", tool_call_parser="hermes")
    finally:
        ae.shutdown()


def test_an_http_stream_that_stops_reading_is_cut_off(tiny_models, monkeypatch):  # type: ignore[no-untyped-def]
    """The server's merge of a response's streams (OpenAIServer.stream_all) holds only a few outputs
    in hand: when the HTTP side stops reading, the outputs wait in the request's own stream, and past
    MAX_UNREAD the request is cut off (before, the merge drained them into a queue of its own without
    bound, so a stalled client kept its request, and its memory, to the end)."""
    from lmserve.server import async_engine as ae_mod
    monkeypatch.setattr(ae_mod, "MAX_UNREAD", 4)
    with merging_server(tiny_models) as (llm, ae, srv):
        async def main():  # type: ignore[no-untyped-def]
            req = ae.process_request(PROMPTS[1], SamplingParams(max_tokens=300, ignore_eos=True))
            it = srv.stream_all([("slow", req)])
            _, first = await it.__anext__()
            assert not first.finished
            for _ in range(500):  # the reader stops: wait for the request to end, one way or the other
                if "slow" not in llm.engine.requests:
                    break
                await asyncio.sleep(0.02)
            return [item async for _, item in it]
        rest = asyncio.run(main())
    assert isinstance(rest[-1], ae_mod.SlowReaderError), rest[-1]
    assert len(rest) < 40  # a handful in hand, not the 300
    assert llm.stats().used_blocks == 0


def test_a_request_that_waits_too_long_is_refused_and_a_started_one_is_not(tiny_models):  # type: ignore[no-untyped-def]
    """max_waiting_time: a request that has waited past it for its first step ends with an error the
    server answers 503 (error_status), in the next step; one already running is never cut, however
    long it has been in the engine."""
    path, _ = tiny_models["llama"]
    llm = LLM(str(path), max_num_seqs=1, max_waiting_time=5.0)
    eng = llm.engine
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    eng.add_request("old-running", PROMPTS[0], params)
    eng.step()  # admitted at once
    eng.requests["old-running"][0].arrival_time -= 60  # as if it had been in the engine a minute
    eng.add_request("stale", PROMPTS[1], params, arrival_time=time.time() - 10)  # waited 10 s already
    eng.add_request("fresh", PROMPTS[2], params)
    done = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o.outputs[0]
    assert done["stale"].finish_reason == "error" and done["stale"].error_status == 503
    assert "max_waiting_time" in done["stale"].error and not done["stale"].token_ids
    assert done["old-running"].finish_reason == "length" and done["fresh"].finish_reason == "length"
    assert llm.stats().used_blocks == 0


def test_a_response_whose_client_left_leaves_no_task_behind(tiny_models):  # type: ignore[no-untyped-def]
    """The client of a streamed response goes away while the merge's queue is full: the merge's
    pump task ends at once and the request is aborted (before, the pump waited forever in its
    `finally` to put an end marker on a queue nobody read: a task, and its outputs, per such client)."""
    with merging_server(tiny_models) as (llm, ae, srv):
        async def main():  # type: ignore[no-untyped-def]
            req = ae.process_request(PROMPTS[1], SamplingParams(max_tokens=400, ignore_eos=True))
            it = srv.stream_all([("gone", req)])
            await it.__anext__()
            await asyncio.sleep(0.5)  # the pump fills the merge's queue and waits on it
            await it.aclose()  # the client went away
            for _ in range(50):
                left = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
                if not left:
                    break
                await asyncio.sleep(0.02)
            return left
        left = asyncio.run(main())
        for _ in range(100):
            if not llm.engine.requests:
                break
            time.sleep(0.02)
    assert not left, left
    assert not llm.engine.requests and llm.stats().used_blocks == 0


def test_a_reader_whose_event_loop_closed_does_not_stop_the_engine(tiny_models):  # type: ignore[no-untyped-def]
    """A request's reader lives on an event loop that ends (asyncio.run returns) while the request still
    runs and before any abort: the engine drops that request and goes on serving (before, handing it
    the next output raised 'Event loop is closed' on the engine thread and the whole loop died)."""
    with merging_server(tiny_models) as (llm, ae, _srv):
        async def start():  # type: ignore[no-untyped-def]
            stream = ae.submit("orphan", ae.process_request(PROMPTS[1], SamplingParams(max_tokens=400, ignore_eos=True)))
            await stream.queue.get()  # it runs; its loop now closes without reading on or aborting
        asyncio.run(start())
        for _ in range(250):
            if not llm.engine.requests or not ae.alive:
                break
            time.sleep(0.02)
        assert ae.alive and ae.error is None
        assert not llm.engine.requests and llm.stats().used_blocks == 0

        async def after():  # type: ignore[no-untyped-def]
            req = ae.process_request(PROMPTS[0], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
            return [o async for o in ae.generate("next", req)][-1]
        last = asyncio.run(after())
        assert last.finished and len(last.outputs[0].token_ids) == 5


def test_a_started_request_is_not_expired_for_a_child_still_waiting(tiny_models):  # type: ignore[no-untyped-def]
    """n = 2 with a one-token prompt: the children are queued from the start, and with room for one
    sequence the second waits while the first runs; past max_waiting_time the request is not ended
    (it has started), both outputs finish (before, the waiting child failed it with a 503)."""
    path, _ = tiny_models["llama"]
    llm = LLM(str(path), max_num_seqs=1, max_waiting_time=5.0)
    eng = llm.engine
    eng.add_request("pair", [7], SamplingParams(n=2, max_tokens=6, temperature=1.0, seed=0, ignore_eos=True))
    eng.step()
    for seq in eng.requests["pair"]:
        seq.arrival_time -= 60
    done = []
    while eng.has_unfinished_requests():
        done += [o for o in eng.step() if o.finished]
    (out,) = done
    assert [c.finish_reason for c in out.outputs] == ["length", "length"], [c.error for c in out.outputs]


def test_a_failed_speculative_step_reports_no_unverified_drafts(tiny_models):  # type: ignore[no-untyped-def]
    """n-gram drafts are on the token list when the verification's forward raises: the request ends
    with the error and the tokens it had, none of the drafts (before, 4 drafts went out as output)."""
    path, _ = tiny_models["llama"]
    eng = LLM(str(path), block_size=4, speculative_method="ngram", num_speculative_tokens=4).engine
    eng.add_request("Y", [9, 3, 4, 5] * 4, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True,
                                                          logit_bias={9: 100}))
    real = eng.runner.forward

    def boom(out):  # type: ignore[no-untyped-def]
        if any(s.spec.num_draft for s, _ in out.scheduled):
            raise RuntimeError("injected fault")
        return real(out)
    eng.runner.forward = boom
    outs = []
    while eng.has_unfinished_requests():
        outs += eng.step()
    final = outs[-1].outputs[0]
    assert final.finish_reason == "error" and "injected fault" in final.error
    assert final.token_ids == [9]  # the first step's token; the drafts that followed it were never verified
    assert eng.spec.stats.as_dict()["proposed"] == 0 and not eng.requests


def test_a_failed_beam_step_ends_the_whole_search_with_its_error(tiny_models):  # type: ignore[no-untyped-def]
    """A token budget of 2 splits a 2-wide beam family over two steps; the step of the second beam
    raises while the first waits with its log-probs. The whole search ends with the error (a 500 at
    the server) and every block is free (the plain request beside it ran in that step or not: its
    error, or all its tokens). Before, the first beam
    waited forever (the engine then raised "scheduler stalled"), and a beam request that failed
    reported success with no outputs."""
    path, _ = tiny_models["llama"]
    eng = LLM(str(path), block_size=4, max_num_batched_tokens=2).engine
    eng.add_request("A", [5, 6], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
    eng.add_request("B", [7, 8, 9], SamplingParams(n=2, use_beam_search=True, max_tokens=6, ignore_eos=True))
    real, fired = eng.runner.forward, []

    def boom(out):  # type: ignore[no-untyped-def]
        beams = [s for s, _ in out.scheduled if s.request_id == "B"]
        waiting = [s for s in eng.requests.get("B", []) if s not in beams and s.family.pending_logprobs is not None]
        if not fired and len(beams) == 1 and waiting:
            fired.append(True)
            raise RuntimeError("injected fault")
        return real(out)
    eng.runner.forward = boom
    done = {}
    for _ in range(100):
        if not eng.has_unfinished_requests():
            break
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o
    assert fired and not eng.has_unfinished_requests()
    (b,) = done["B"].outputs
    assert b.finish_reason == "error" and "injected fault" in b.error and b.error_status == 500
    assert all(c.finish_reason in ("error", "length") for c in done["A"].outputs)
    assert eng.stats().used_blocks == 0


def test_an_expired_beam_search_answers_503(tiny_models):  # type: ignore[no-untyped-def]
    """A beam request past max_waiting_time ends with its 503 error, as a plain one does (before: a
    finished request with no outputs, which the server answered with 200 and no choices)."""
    path, _ = tiny_models["llama"]
    eng = LLM(str(path), block_size=4, max_waiting_time=1.0).engine
    old = time.time() - 5
    eng.add_request("B", [7, 8, 9], SamplingParams(n=2, use_beam_search=True, max_tokens=6, ignore_eos=True),
                    arrival_time=old)
    eng.add_request("P", [7, 8, 9], SamplingParams(max_tokens=6), arrival_time=old)
    outs = {o.request_id: o for o in eng.step()}
    for rid in ("B", "P"):
        assert outs[rid].finished
        assert [(c.finish_reason, c.error_status) for c in outs[rid].outputs] == [("error", 503)]


def test_a_failure_while_drafting_leaves_the_step_to_run_plainly(tiny_models):  # type: ignore[no-untyped-def]
    """The proposer raises on every other call: those steps run without drafts, the engine goes on,
    and the tokens are plain decoding's (before, the exception left Engine.step: generate() died and
    the server failed every request in flight)."""
    path, _ = tiny_models["llama"]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    ref = LLM(str(path)).generate(PROMPTS, params, use_tqdm=False)
    llm = LLM(str(path), speculative_method="ngram", num_speculative_tokens=3, spec_min_acceptance=0.0)
    proposer, calls = llm.engine.spec.proposer, {"n": 0}
    real = proposer.propose

    def flaky(seqs, ks):  # type: ignore[no-untyped-def]
        calls["n"] += 1
        if calls["n"] % 2:
            raise RuntimeError("injected drafting fault")
        return real(seqs, ks)
    proposer.propose = flaky
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]
    assert calls["n"] > 2 and llm.stats().used_blocks == 0


def test_generate_that_raises_takes_its_requests_out_of_the_engine(tiny_models):  # type: ignore[no-untyped-def]
    """Engine.step raises out of LLM.generate (an engine error, or Ctrl-C): the call's requests are
    aborted with it, their blocks free, and the next generate() runs alone (before, they stayed in
    the engine and ran inside the next call, holding blocks)."""
    path, _ = tiny_models["llama"]
    llm = LLM(str(path))
    llm.engine.step = FailOnCall(llm.engine.step, 3, KeyboardInterrupt())
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(PROMPTS, params, use_tqdm=False)
    assert not llm.engine.requests and llm.stats().used_blocks == 0
    outs = llm.generate(PROMPTS[:1], params, use_tqdm=False)
    assert len(outs[0].outputs[0].token_ids) == 20 and not llm.engine.requests


def test_a_request_to_a_stopping_loop_is_refused_at_once(tiny_models):  # type: ignore[no-untyped-def]
    """Between the loop's last _fail_all (which fails what is pending) and the end of its thread, a new
    request must be refused, not queued where nobody reads it again (before, generate checked only
    that the thread was alive: the request waited forever). The window is held open here: the loop is
    stopped and a stand-in thread still counts as alive."""
    from lmserve.server.async_engine import AsyncEngine, EngineDeadError
    path, _ = tiny_models["llama"]
    llm = LLM(str(path))
    ae = AsyncEngine(llm.engine)
    ae.start()
    ae.shutdown()
    ae._stop.set()

    class StillAlive:
        def is_alive(self) -> bool:
            return True

    ae._thread = StillAlive()  # type: ignore[assignment]
    req = llm.engine.process_request([5, 6, 7], SamplingParams(max_tokens=2))

    async def ask() -> None:
        async for _ in ae.generate("late", req):
            pass

    with pytest.raises(EngineDeadError):
        asyncio.run(asyncio.wait_for(ask(), timeout=3))


def test_a_beam_step_that_raises_ends_its_search_alone(tiny_models, monkeypatch):  # type: ignore[no-untyped-def]
    """The beam step itself raising (after the forward, in FanOut): that search ends with its error and
    every block is free; the plain request beside it gets all its tokens (before, the exception left
    Engine.step: the server failed every request in flight)."""
    from lmserve.sampling import beam
    path, _ = tiny_models["llama"]
    llm = LLM(str(path), block_size=4)
    calls = []

    def boom(self, *a):  # type: ignore[no-untyped-def]
        calls.append(1)
        if len(calls) == 3:
            raise ArithmeticError("injected in the beam step")
        return real(self, *a)

    real = beam.BeamState.step
    monkeypatch.setattr(beam.BeamState, "step", boom)
    outs = llm.generate([[5, 6], [7, 8, 9]], [SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
                                              SamplingParams(n=2, use_beam_search=True, max_tokens=6, ignore_eos=True)],
                        use_tqdm=False)
    (b,) = outs[1].outputs
    assert b.finish_reason == "error" and "injected in the beam step" in b.error and b.error_status == 500
    assert len(outs[0].outputs[0].token_ids) == 12 and outs[0].outputs[0].finish_reason == "length"
    assert llm.stats().used_blocks == 0 and not llm.engine.requests


def test_a_loop_that_dies_outside_a_step_tells_its_readers_why_and_ends_the_server(tiny_models, monkeypatch):  # type: ignore[no-untyped-def]
    """The engine loop dying of anything (here its stats snapshot raising) fails the requests in flight
    with the cause ('the engine loop died: ...', not 'the server is shutting down') and runs on_fatal,
    which makes `lmserve serve` exit as vLLM's server does (it stayed up answering 503 forever)."""
    from lmserve.server import async_engine as ae_mod
    path, _ = tiny_models["llama"]
    llm = LLM(str(path))
    ae = ae_mod.AsyncEngine(llm.engine)
    fatal: list[BaseException] = []
    ae.on_fatal = fatal.append
    monkeypatch.setattr(ae, "_publish", FailOnCall(ae._publish, 3, RuntimeError("snapshot broke")))
    monkeypatch.setattr(ae_mod, "STATS_INTERVAL_S", 0.0)  # a snapshot every step
    ae.start()
    try:
        async def main():  # type: ignore[no-untyped-def]
            with pytest.raises(ae_mod.EngineDeadError, match="the engine loop died: RuntimeError: snapshot broke"):
                async for _ in ae.generate("r", ae.process_request(PROMPTS[0], SamplingParams(max_tokens=50,
                                                                                             ignore_eos=True))):
                    pass
        asyncio.run(asyncio.wait_for(main(), 30))
        ae._thread.join(10)
        assert not ae.alive and [str(e) for e in fatal] == ["snapshot broke"]
    finally:
        ae.shutdown()


def test_readers_hear_of_a_failed_step_even_when_its_clean_up_fails(tiny_models, monkeypatch):  # type: ignore[no-untyped-def]
    """A failed step whose clean-up (abort_request) also raises: the readers were told only after the
    aborts, so they waited forever (no --request-timeout by default). Now they get the step's error
    first; the engine loop goes on serving the next request."""
    from lmserve.server import async_engine as ae_mod
    path, _ = tiny_models["llama"]
    llm = LLM(str(path))
    eng = llm.engine
    real_step, real_abort, broken = eng.step, eng.abort_request, {"on": True}

    def step():  # type: ignore[no-untyped-def]
        if broken["on"] and eng.requests:
            raise RuntimeError("step failed")
        return real_step()

    def abort(rid):  # type: ignore[no-untyped-def]
        if broken["on"]:
            broken["on"] = False
            raise RuntimeError("abort failed")
        return real_abort(rid)
    monkeypatch.setattr(eng, "step", step)
    monkeypatch.setattr(eng, "abort_request", abort)
    ae = ae_mod.AsyncEngine(eng)
    ae.start()
    try:
        async def main():  # type: ignore[no-untyped-def]
            with pytest.raises(RuntimeError, match="step failed"):
                async for _ in ae.generate("a", ae.process_request(PROMPTS[0], SamplingParams(max_tokens=8))):
                    pass
            outs = [o async for o in ae.generate("b", ae.process_request(PROMPTS[1], SamplingParams(
                max_tokens=5, ignore_eos=True)))]
            assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 5
        asyncio.run(asyncio.wait_for(main(), 30))
    finally:
        ae.shutdown()
