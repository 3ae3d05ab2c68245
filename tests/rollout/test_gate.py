"""The generation gate and resumable requests, engine-free (asyncio with a scripted engine)."""
from __future__ import annotations

import asyncio

from megarl.rollout.gate import GenerationGate, Segment, generate_group_resumable, generate_resumable, segment_seed


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


def test_a_group_request_aborted_by_a_sync_continues_each_sample_alone_as_its_own_request_would():
    """Sample k of a group is seeded ``seed + k``; after an abort it continues alone from segment 1 with
    ``segment_seed(seed + k, 1)``: exactly what a single request with seed ``seed + k`` would do."""
    async def scenario():
        gate, version, group_calls, calls = GenerationGate(), {"v": 3}, [], []
        syncs = []

        async def sync(abort):
            await gate.close(abort)
            version["v"] = 4
            gate.open()

        async def run_group(request_id, ids, max_tokens, seed):
            group_calls.append((list(ids), max_tokens, seed))
            aborted = asyncio.Event()

            async def abort(request_ids):
                assert request_ids == [request_id]
                aborted.set()

            syncs.append(asyncio.ensure_future(sync(abort)))
            await aborted.wait()
            # sample 0 had finished before the sync; sample 1 is cut after one token
            return [Segment([20], [-2.0], "stop", None, "done"), Segment([30], [-3.0], "abort", None, "")]

        async def run_segment(request_id, ids, max_tokens, seed):
            calls.append((list(ids), max_tokens, seed))
            return Segment([31, 32], [-3.1, -3.2], "stop", None, "")

        first, second = await generate_group_resumable(gate, run_group, run_segment, [1, 2], 4, seed=50,
                                                       version=lambda: version["v"], tag="g",
                                                       detokenize=lambda ids: "-".join(map(str, ids)))
        await syncs[0]
        assert group_calls == [([1, 2], 4, 50)]
        assert (first.token_ids, first.versions, first.text, first.finish_reason) == ([20], [3], "done", "stop")
        assert calls == [([1, 2, 30], 3, segment_seed(51, 1))]  # sample 1 = seed 50 + 1, its segment 1
        assert second.token_ids == [30, 31, 32] and second.versions == [3, 4, 4] and second.text == "30-31-32"

    asyncio.run(scenario())
