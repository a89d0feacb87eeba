"""What the web console's engine view shows: snapshots the engine thread publishes, read by any thread.

The engine thread (AsyncEngine's loop) calls `after_step` after each step and `idle` when it waits, but
only while a viewer is connected (`watched`): with none, the loop does not call in at all. A snapshot
is built at most every VIEW_INTERVAL_S, as a plain dict, and published by replacing one reference
(`latest`: its sequence number and the dict): readers never take a lock and never touch the engine.

A snapshot holds the KV pool as one character per block (BLOCK_CODES), the running and waiting requests
with their phase (at most MAX_LISTED of each), the last step's batch (prefill and decode tokens against
the token budget), cumulative counters (output tokens, preemptions, prefix hits), and the requests that
finished since the previous snapshot with their TTFT and TPOT: what the page needs to draw its charts.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

VIEW_INTERVAL_S = 0.2
MAX_LISTED = 64
# free (no content) | cached (free, its content kept for a prefix hit, evictable) | in use by 1..8, 9+
BLOCK_CODES = {"free": ".", "cached": "c", **{str(n): str(n) for n in range(1, 10)}}


class EngineView:
    """Snapshots of one engine for the web console (see the module doc)."""

    def __init__(self) -> None:
        self.viewers = 0  # connected viewers (the web side counts them); 0: the loop never calls in
        self.failed = False  # an update raised: the view stays dark (the engine loop goes on)
        self.latest: tuple[int, dict[str, Any]] | None = None  # (sequence number, snapshot), swapped whole
        self._seq = 0
        self._reset = False  # a viewer arrived after a time unwatched: forget the token counts seen then
        self._at = 0.0
        self._dirty = True  # a step ran since the last snapshot
        self._lens: dict[str, int] = {}  # request -> output tokens seen so far
        self._tokens = 0  # output tokens produced while watched
        self._done: deque[dict[str, Any]] = deque(maxlen=256)

    @property
    def watched(self) -> bool:
        """Whether the engine loop should update the view."""
        return self.viewers > 0 and not self.failed

    def stale(self) -> None:
        """Publish on the loop's next pass (a new viewer wants the engine as it is now). Any thread."""
        self._dirty = self._reset = True

    # ------------------------------------------------------------ engine thread
    def after_step(self, engine: Any, outputs: list[Any]) -> None:
        if self._reset:  # requests seen before the gap: their counts restart (no spike of old tokens)
            self._reset = False  # every request's tokens so far, those without output this step too
            self._lens = {rid: sum(s.num_output_tokens for s in seqs) for rid, seqs in engine.requests.items()}
            self._lens.update({o.request_id: sum(len(c.token_ids) for c in o.outputs) for o in outputs})
            outputs = [o for o in outputs if o.finished]
        for out in outputs:
            n = sum(len(o.token_ids) for o in out.outputs)
            self._tokens += max(0, n - self._lens.get(out.request_id, 0))
            if out.finished:
                self._lens.pop(out.request_id, None)
                m = out.metrics
                self._done.append({"id": out.request_id[-12:], "ttft": m.ttft, "tpot": m.tpot, "tokens": n})
            else:
                self._lens[out.request_id] = n
        self._dirty = True
        if time.monotonic() - self._at >= VIEW_INTERVAL_S:
            self.publish(engine)

    def idle(self, engine: Any) -> None:
        """Between requests: one last snapshot of the quiet engine (all blocks back), then nothing."""
        self._lens.clear()
        if self._dirty or self.latest is None:
            self.publish(engine)

    def publish(self, engine: Any) -> None:
        self._seq += 1
        self.latest = (self._seq, snapshot(engine, self._tokens, list(self._done)))
        self._done.clear()
        self._at, self._dirty = time.monotonic(), False


def _phase(seq: Any, running: bool) -> str:
    if not running:
        if seq.swapped is not None:
            return "swapped"
        return "preempted" if seq.num_output_tokens > 0 else "waiting"
    return "prefill" if seq.num_computed_tokens < seq.num_prompt_tokens else "decode"


def _listed(seqs: Any, running: bool) -> list[dict[str, Any]]:
    out = []
    for seq in seqs:
        if len(out) == MAX_LISTED:
            break
        out.append({"id": seq.request_id[-12:], "phase": _phase(seq, running), "prompt": seq.num_prompt_tokens,
                    "computed": seq.num_computed_tokens, "output": seq.num_output_tokens,
                    "blocks": sum(len([b for b in t if b >= 0]) for t in seq.block_tables)})
    return out


def blocks(bm: Any) -> str:
    """The pool, one character per block (BLOCK_CODES)."""
    return "".join(str(min(r, 9)) if r else ("c" if h is not None else ".")
                   for r, h in zip(bm.ref_count, bm.block_hash))


def snapshot(engine: Any, output_tokens: int, done: list[dict[str, Any]]) -> dict[str, Any]:
    """The engine as it stands (engine thread only)."""
    sch, bm = engine.scheduler, engine.block_manager
    st = sch.stats
    prefill, decode = sch.last_batch
    return {
        "time": time.time(), "block_size": bm.block_size, "blocks": blocks(bm),
        "running": _listed(sch.running, True), "waiting": _listed(sch.waiting, False),
        "num_running": len(sch.running), "num_waiting": len(sch.waiting),
        "batch": {"prefill": prefill, "decode": decode, "budget": sch.max_num_batched_tokens},
        "output_tokens": output_tokens, "computed_tokens": st.computed_tokens,
        "preemptions": st.num_preemptions, "prefix_hit_tokens": st.prefix_hit_tokens,
        "prompt_tokens_queried": st.prompt_tokens_queried, "finished": done,
    }
