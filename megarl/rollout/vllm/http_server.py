"""vLLM's OpenAI-compatible HTTP server, run on an engine a replica already hosts.

``serve_openai(engine, model_path, host)`` builds vLLM's own FastAPI app (the routes of ``vllm
serve``: ``/v1/chat/completions``, ``/v1/completions``, ``/classify``, ``/pooling``,
``/tokenize``, ``/v1/models``, ``/health``, as the engine's tasks allow) on the replica's
``AsyncLLM`` and serves it with uvicorn in the replica's event loop; no second engine starts. The
reward model and the LLM judge use it, so reward functions written for verl (which POST to
``reward_router_address``) run unchanged. Requests name the model by its path (vLLM's default
served name), as verl's do.
"""
from __future__ import annotations

import asyncio
import logging
import socket
from typing import Any

logger = logging.getLogger(__name__)


class OpenAIServer:
    """A running server: ``address`` is ``host:port``; ``close`` stops it."""

    def __init__(self, server: Any, task: asyncio.Task, address: str):
        self._server, self._task, self.address = server, task, address

    async def close(self) -> None:
        self._server.should_exit = True
        try:
            await asyncio.wait_for(self._task, timeout=10)
        except (asyncio.TimeoutError, asyncio.CancelledError):
            self._task.cancel()


async def serve_openai(engine: Any, model_path: str, host: str, start_timeout_s: float = 60) -> OpenAIServer:
    """Serve ``engine`` (a vLLM ``AsyncLLM``) over HTTP on ``host`` at a free port."""
    import uvicorn
    from vllm.entrypoints.launchers.api_server.app_state import init_app_state
    from vllm.entrypoints.launchers.app import build_app
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))
    port = sock.getsockname()[1]
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(
        ["--model", model_path, "--host", host, "--port", str(port), "--disable-log-stats",
         "--disable-uvicorn-access-log", "--disable-fastapi-docs"])
    tasks = await engine.get_supported_tasks()
    app = build_app(args, tasks, engine.model_config)
    await init_app_state(engine, app.state, args, tasks)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, timeout_keep_alive=30))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    loop = asyncio.get_running_loop()
    deadline = loop.time() + start_timeout_s
    while not server.started:
        if task.done():
            task.result()  # raises the server's start-up error
            raise RuntimeError(f"vLLM's HTTP server on {host}:{port} stopped while starting")
        if loop.time() > deadline:
            server.should_exit = True
            raise TimeoutError(f"vLLM's HTTP server on {host}:{port} did not start within {start_timeout_s:g} s")
        await asyncio.sleep(0.05)
    logger.info("OpenAI-compatible server for %s on http://%s:%d (tasks: %s)", model_path, host, port, ", ".join(tasks))
    return OpenAIServer(server, task, f"{host}:{port}")
