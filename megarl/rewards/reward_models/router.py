"""One HTTP address for several reward-model replicas: a small reverse proxy (a Ray async actor).

verl hands a reward function one ``reward_router_address``; with more than one replica megarl puts
this router in front of their OpenAI-compatible servers. Every request (any path, any method) goes
to the replica with the fewest requests in flight (ties: round robin) and its answer comes back
unchanged, status included, so a client's retry rules see the replica's own errors. A replica that
cannot be reached gives 502, which clients retry.
"""
from __future__ import annotations

import itertools
import logging

logger = logging.getLogger(__name__)


class ReplicaRouter:
    """Serve on ``host`` at a free port, forwarding to ``backends`` (``host:port`` each)."""

    def __init__(self, backends: list[str]):
        if not backends:
            raise ValueError("a router needs at least one backend")
        self.backends = list(backends)
        self.in_flight = {b: 0 for b in self.backends}
        self._turn = itertools.count()
        self._runner = self._session = None
        self.address: str | None = None

    async def start(self, host: str) -> str:
        import aiohttp
        from aiohttp import web

        app = web.Application(client_max_size=1 << 30)
        app.router.add_route("*", "/{path:.*}", self._forward)
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))
        self._runner = web.AppRunner(app, access_log=None, handler_cancellation=True, shutdown_timeout=5)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # noqa: SLF001 - aiohttp has no public accessor
        self.address = f"{host}:{port}"
        logger.info("reward-model router on http://%s -> %s", self.address, ", ".join(self.backends))
        return self.address

    def _pick(self) -> str:
        turn = next(self._turn)
        fewest = min(self.in_flight.values())
        candidates = [b for b in self.backends if self.in_flight[b] == fewest]
        return candidates[turn % len(candidates)]

    async def _forward(self, request):
        import aiohttp
        from aiohttp import web

        backend = self._pick()
        self.in_flight[backend] += 1
        try:
            body = await request.read()
            headers = {k: v for k, v in request.headers.items() if k.lower() not in ("host", "content-length")}
            async with self._session.request(request.method, f"http://{backend}{request.rel_url}", data=body,
                                             headers=headers) as answer:
                payload = await answer.read()
                kept = {k: v for k, v in answer.headers.items()
                        if k.lower() not in ("content-length", "transfer-encoding", "content-encoding", "connection")}
                return web.Response(status=answer.status, body=payload, headers=kept)
        except aiohttp.ClientError as exc:
            return web.Response(status=502, text=f"reward-model replica {backend} unreachable: {exc}")
        finally:
            self.in_flight[backend] -= 1

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()
        self._runner = self._session = None
