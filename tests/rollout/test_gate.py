"""The generation gate and resumable requests, engine-free (asyncio with a scripted engine)."""
from __future__ import annotations

import asyncio

from megarl.rollout.gate import GenerationGate, Segment, generate_resumable, segment_seed


def test_close_waits_for_running_requests_or_aborts_them_and_nests():
    async def scenario():
        gate, events = GenerationGate(), []
        await gate.enter("a")
        closing = asyncio.ensure_future(gate.close())  # wait mode: returns once "a" left
        await asyncio.sleep(0.01)
        assert not closing.done() and not gate.is_open
        gate.leave("a")
        await closing
        second = asyncio.ensure_future(gate.enter("b"))  # waits while the gate is held
        await asyncio.sleep(0.01)
        assert not second.done()
        await gate.close()  # a second hold
        gate.open()
        await asyncio.sleep(0.01)
        assert not second.done()  # still held once
        gate.open()
        await second
        assert gate.running == 1

        async def abort(ids):
            events.append(ids)
            for request in ids:
                gate.leave(request)

        await gate.close(abort)
        assert events == [["b"]] and gate.running == 0
        gate.open()

    asyncio.run(scenario())


def test_a_request_aborted_by_a_sync_continues_with_the_new_version_and_its_tokens():
    async def scenario():
        gate, version, calls, syncs = GenerationGate(), {"v": 3}, [], []

        async def sync(abort):
            await gate.close(abort)  # aborts the running request, returns once it left the gate
            version["v"] = 4
            gate.open()

        async def run_segment(request_id, ids, max_tokens, seed):
            calls.append((list(ids), max_tokens, seed))
            if len(calls) == 1:  # the first segment is cut by a sync after 2 tokens
                aborted = asyncio.Event()

                async def abort(request_ids):
                    assert request_ids == [request_id]
                    aborted.set()

                syncs.append(asyncio.ensure_future(sync(abort)))
                await aborted.wait()
                return Segment([10, 11], [-1.0, -1.1], "abort", None, "")
            return Segment([12, 13, 14], [-1.2, -1.3, -1.4], "length", None, "tail")

        g = await generate_resumable(gate, run_segment, [1, 2], 5, seed=77, version=lambda: version["v"],
                                     tag="t", detokenize=lambda ids: "-".join(map(str, ids)))
        await syncs[0]
        assert g.token_ids == [10, 11, 12, 13, 14] and g.versions == [3, 3, 4, 4, 4]
        assert g.logprobs == [-1.0, -1.1, -1.2, -1.3, -1.4] and g.finish_reason == "length"
        assert calls[1] == ([1, 2, 10, 11], 3, segment_seed(77, 1)) and calls[0][2] == 77  # prompt + tokens so far
        assert g.text == "10-11-12-13-14"  # detokenised whole: it ran in two segments

    asyncio.run(scenario())
