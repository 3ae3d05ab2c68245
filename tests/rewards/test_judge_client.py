"""The judge client against a scripted HTTP judge (retries, timeouts, no retry on request errors,
concurrency), the score parser, the router, and the reward manager's use of both kinds of reward
model (fallback scores and their metrics; rm_score / rm_scores). No engine starts: the server is
an aiohttp app on 127.0.0.1 in a thread of the test process."""
from __future__ import annotations

import asyncio
import contextlib
import pickle
import textwrap
import threading
import time
from collections import Counter

import pytest

from megarl.rewards import RewardManager, RewardFunction
from megarl.rewards.reward_models import JudgeClient, JudgeError, JudgeRequestError, JudgeSettings, parse_score
from megarl.rewards.reward_models.router import ReplicaRouter
from megarl.rewards.reward_models.service import ModelScores
from megarl.rewards.rate_limit import LimitSettings


class ScriptedJudge:
    """An OpenAI-style judge whose behaviour the prompt picks: ``ok:<answer>``, ``fail500:<n>:<answer>``
    (n server errors first), ``busy429:<n>:<answer>``, ``bad400``, ``hang``, ``slow:<seconds>:<answer>``,
    ``nojson``. Counts requests per prompt and the most in flight at once."""

    def __init__(self, status_override: int | None = None):
        self.seen: Counter = Counter()
        self.in_flight = self.most_in_flight = 0
        self.status_override = status_override
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.address = asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(10)

    async def _start(self) -> str:
        from aiohttp import web

        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._answer)
        app.router.add_post("/v1/completions", self._answer)
        # a client that gives up cancels its handler
        self.runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=0.5)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        return f"127.0.0.1:{site._server.sockets[0].getsockname()[1]}"

    async def _answer(self, request):
        from aiohttp import web

        body = await request.json()
        chat = "messages" in body
        prompt = body["messages"][-1]["content"] if chat else body["prompt"]
        self.seen[prompt] += 1
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            if self.status_override:
                return web.Response(status=self.status_override, text="overridden")
            kind, *rest = prompt.split(":")
            if kind in ("fail500", "busy429") and self.seen[prompt] <= int(rest[0]):
                return web.Response(status=500 if kind == "fail500" else 429, text="try later")
            if kind == "bad400":
                return web.Response(status=400, text="prompt too long")
            if kind == "hang":
                await asyncio.sleep(3600)
            if kind == "slow":
                await asyncio.sleep(float(rest[0]))
            if kind == "nojson":
                return web.Response(status=200, text="<html>")
            answer = rest[-1]
            choice = {"message": {"role": "assistant", "content": answer}} if chat else {"text": answer}
            return web.json_response({"choices": [choice], "model": body["model"]})
        finally:
            self.in_flight -= 1

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture()
def judge_server():
    server = ScriptedJudge()
    yield server
    server.close()


def client_for(server, **settings) -> JudgeClient:
    values = dict(timeout_s=5.0, max_retries=3, retry_backoff_s=0.01, max_concurrent=64)
    values.update(settings)
    return JudgeClient(server.address, "judge-model", JudgeSettings(**values))


def chat(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def test_answers_come_back_in_order_from_both_endpoints(judge_server):
    client = client_for(judge_server)
    assert client.generate([chat("ok:7"), "ok:plain text", chat("slow:0.2:late"), chat("ok:3")]) == [
        "7", "plain text", "late", "3"]
    assert client.stats["requests"] == 4 and client.stats["retries"] == 0


def test_server_errors_are_retried_request_errors_are_not(judge_server):
    client = client_for(judge_server, max_retries=3)
    assert client.generate([chat("fail500:2:8"), chat("busy429:1:5")]) == ["8", "5"]
    assert judge_server.seen["fail500:2:8"] == 3 and judge_server.seen["busy429:1:5"] == 2
    assert client.stats["retries"] == 3
    with pytest.raises(JudgeError, match="failed 4 time"):
        client.generate([chat("fail500:99:x")])
    assert judge_server.seen["fail500:99:x"] == 4  # the first try and max_retries=3 more
    with pytest.raises(JudgeRequestError, match="HTTP 400, not retried"):
        client.generate([chat("bad400")])
    assert judge_server.seen["bad400"] == 1
    with pytest.raises(JudgeError, match="no choices"):
        client.generate([chat("nojson")])


def test_a_hung_or_unreachable_judge_fails_within_its_time_bound(judge_server):
    client = client_for(judge_server, timeout_s=0.3, max_retries=1)
    start = time.perf_counter()
    with pytest.raises(JudgeError, match="no answer within 0.3 s"):
        client.generate([chat("hang")])
    assert time.perf_counter() - start < 3 and judge_server.seen["hang"] == 2
    gone = JudgeClient("127.0.0.1:9", "judge-model", JudgeSettings(timeout_s=1, max_retries=2, retry_backoff_s=0.01))
    with pytest.raises(JudgeError, match="failed 3 time"):
        gone.generate(["ok:1"])


def test_at_most_max_concurrent_requests_are_in_flight(judge_server):
    client = client_for(judge_server, max_concurrent=2)
    assert client.generate([chat(f"slow:0.15:{i}") for i in range(6)]) == [str(i) for i in range(6)]
    assert judge_server.most_in_flight == 2


def test_the_client_pickles_and_refuses_the_sync_call_inside_a_loop(judge_server):
    client = pickle.loads(pickle.dumps(client_for(judge_server)))
    assert client.generate([chat("ok:4")]) == ["4"]

    async def inside():
        with pytest.raises(RuntimeError, match="await judge.agenerate"):
            client.generate([chat("ok:4")])
        return await client.agenerate([chat("ok:5")])

    assert asyncio.run(inside()) == ["5"]
    with pytest.raises(ValueError, match="one answer per prompt"):
        client.generate([chat("ok:1")], {"n": 2})


@pytest.mark.parametrize("text, expected", [
    ("Score: 7", 7.0), ("The rating is 8.5 out of 10", 8.5), ("<score>9</score> (not 2)", 9.0), ("I give it 6/10.", 6.0),
    ("\\boxed{3}", 3.0), ("first 2, finally 4", 4.0), ("Score: 11", None), ("no number at all", None), ("", None),
    (None, None), ("Score: -1", None), ("score:\n**5**", 5.0),
])
def test_the_parser_reads_scores_and_rejects_malformed_judgements(text, expected):
    assert parse_score(text, 0, 10) == expected


def test_the_router_spreads_requests_and_passes_answers_through():
    servers = [ScriptedJudge(), ScriptedJudge(), ScriptedJudge(status_override=503)]

    async def scenario():
        router = ReplicaRouter([servers[0].address, servers[1].address])
        address = await router.start("127.0.0.1")
        client = JudgeClient(address, "judge-model", JudgeSettings(retry_backoff_s=0.01))
        answers = await client.agenerate([chat(f"slow:0.1:{i}") for i in range(8)])
        await router.stop()
        failing = ReplicaRouter([servers[2].address, "127.0.0.1:9"])
        address = await failing.start("127.0.0.1")
        import httpx

        async with httpx.AsyncClient(base_url=f"http://{address}") as http:
            statuses = {(await http.post("/v1/completions", json={"prompt": "ok:1", "model": "m"})).status_code
                        for _ in range(4)}
        await failing.stop()
        return answers, statuses

    try:
        answers, statuses = asyncio.run(scenario())
    finally:
        for server in servers:
            server.close()
    assert answers == [str(i) for i in range(8)]
    assert sum(servers[0].seen.values()) == sum(servers[1].seen.values()) == 4
    assert statuses == {503, 502}  # a replica's own error as it is; an unreachable one as 502


# ---------------------------------------------------------------------- the reward manager with reward models
class FakeReward:
    """The reward-model side the manager uses (what ``RewardModelService`` offers), without engines."""

    def __init__(self, judge: JudgeClient | None = None, scores: list[float] | None = None):
        self.judge, self._scores, self.passes = judge, scores, 0
        self.scores_responses = scores is not None

    @contextlib.contextmanager
    def awake(self):
        self.passes += 1
        yield

    def score(self, batch) -> ModelScores:
        return ModelScores(list(self._scores), {"reward_model/score/mean": sum(self._scores) / len(self._scores)})

    def context(self, names):
        offered = {"reward_router_address": self.judge.address if self.judge else "h:1", "reward_model_tokenizer": None}
        if self.judge is not None:
            offered["judge"] = self.judge
        return {k: v for k, v in offered.items() if k in names}

    def client_metrics(self):
        return {}


JUDGED = textwrap.dedent('''
    import time
    from megarl.rewards.reward_models import JudgeError, parse_score

    async def judged(data_source, solution_str, ground_truth, extra_info, judge):
        (answer,) = await judge.agenerate([[{"role": "user", "content": solution_str}]])
        score = parse_score(answer, 0, 10)
        if score is None:
            raise JudgeError(f"no score in {answer!r}")
        return score / 10

    def slow_sync(data_source, solution_str, ground_truth, extra_info=None, judge=None):
        time.sleep(float(solution_str))
        return 1.0

    def hybrid(data_source, solution_str, ground_truth, extra_info, rm_score):
        return {"score": rm_score + float(solution_str == ground_truth), "rule": float(solution_str == ground_truth)}

    def batch_hybrid(data_sources, solution_strs, ground_truths, extra_infos, rm_scores, reward_router_address=None):
        return [s + 10 for s in rm_scores]
''')


@pytest.fixture()
def judged(tmp_path):
    path = tmp_path / "judged.py"
    path.write_text(JUDGED)
    return str(path)


def test_judge_failures_score_the_fallback_and_are_counted_never_a_hung_step(judge_server, judged):
    client = client_for(judge_server, timeout_s=0.3, max_retries=1)
    manager = RewardManager(RewardFunction(judged, "judged"), model_reward=FakeReward(client), fallback_score=-1.0)
    texts = ["ok:Score: 8", "fail500:1:6/10", "fail500:9:7", "hang", "bad400", "ok:I cannot decide", "ok:<score>3</score>"]
    start = time.perf_counter()
    result = manager.score(["judge"] * len(texts), texts, [""] * len(texts), [{}] * len(texts))
    assert time.perf_counter() - start < 5  # all concurrent; each failure bounded by its timeout and retries
    assert result.scores == [0.8, 0.6, -1.0, -1.0, -1.0, -1.0, 0.3]
    assert result.metrics["reward/judge_failures"] == 4 and result.metrics["reward/num_errors"] == 0
    assert manager.model_reward.passes == 1


def test_the_rate_limited_manager_bounds_calls_and_times_them_out(judged):
    limits = LimitSettings(max_concurrent=2, timeout_s=0.5)
    manager = RewardManager(RewardFunction(judged, "slow_sync"), kind="limited", limits=limits, fallback_score=0.25)
    start = time.perf_counter()
    result = manager.score(["x"] * 5, ["0.2", "0.2", "0.2", "0.2", "5"], [""] * 5)
    took = time.perf_counter() - start
    assert result.scores == [1.0, 1.0, 1.0, 1.0, 0.25]
    assert result.metrics["reward/timeouts"] == 1 and result.metrics["reward/judge_failures"] == 1
    assert 0.5 < took < 3  # two at a time: the four short calls take two rounds; the long one stops at 0.5 s
    with pytest.raises(ValueError, match="reward_model.max_concurrent"):
        RewardManager(RewardFunction(judged, "slow_sync"), kind="rate_limited", num_workers=2)


def test_a_discriminative_reward_model_is_the_reward_or_reaches_the_function(judged):
    from megarl.rewards.reward_models import ResponsesToScore

    inputs = ResponsesToScore([[1]] * 3, [[2]] * 3, [[{"role": "user", "content": "q"}]] * 3, ["a", "b", "c"])
    model = FakeReward(scores=[0.5, -0.25, 2.0])
    plain = RewardManager(model_reward=model).score(["src"] * 3, ["a", "b", "c"], ["a"] * 3, model_inputs=inputs)
    assert plain.scores == [0.5, -0.25, 2.0] and plain.metrics["reward_model/score/mean"] == pytest.approx(0.75)
    hybrid = RewardManager(RewardFunction(judged, "hybrid"), model_reward=model).score(
        ["src"] * 3, ["a", "b", "c"], ["a"] * 3, model_inputs=inputs)
    assert hybrid.scores == [1.5, -0.25, 2.0] and hybrid.extra["rule"] == [1.0, 0.0, 0.0]
    batch = RewardManager(RewardFunction(judged, "batch_hybrid"), model_reward=model).score(
        ["src"] * 3, ["a", "b", "c"], ["a"] * 3, model_inputs=inputs)
    assert batch.scores == [10.5, 9.75, 12.0]
    with pytest.raises(ValueError, match="needs the prompts and responses"):
        RewardManager(model_reward=model).score(["src"] * 3, ["a", "b", "c"], ["a"] * 3)
