"""A small scripted OpenAI-compatible policy server (aiohttp) standing in for the user's model in
the rollout tests and benchmark: ``/<name>/v1/chat/completions`` answers turn n (the number of
assistant messages in the request) with ``scripts[name][n]``."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from aiohttp import web

from bus.natsd import free_port

Script = list[Any]  # per turn: a reply body (dict or raw str), "hang", or an async callable returning one


def call(name: str, n: int = 0, **args: Any) -> dict[str, Any]:
    return {"id": f"call-{name}-{n}", "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}


def answer(content: str | None, *calls: dict[str, Any], **extra: Any) -> dict[str, Any]:
    """A chat completion; ``extra`` goes into the choice (token_ids, logprobs as vLLM returns them)."""
    msg: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        msg["tool_calls"] = list(calls)
    choice = {"index": 0, "message": msg, "finish_reason": "tool_calls" if calls else "stop", **extra}
    return {"id": "cmpl", "object": "chat.completion", "choices": [choice], "prompt_token_ids": [7, 8, 9]}


class Policy:
    """Scripted policies on one server: ``/<name>/v1/chat/completions`` answers turn n (the number of
    assistant messages in the request) with ``scripts[name][n]``."""

    def __init__(self) -> None:
        self.scripts: dict[str, Script] = {}
        self.requests: dict[str, list[dict[str, Any]]] = {}
        self.runner: web.AppRunner | None = None
        self.port = 0
        self.never = asyncio.Event()

    def url(self, name: str, script: Script) -> str:
        self.scripts[name] = script
        self.requests[name] = []
        return f"http://127.0.0.1:{self.port}/{name}/v1"

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        name = request.match_info["name"]
        body = await request.json()
        self.requests[name].append(body)
        turn = sum(1 for m in body["messages"] if m["role"] == "assistant")
        step = self.scripts[name][turn]
        if step == "hang":
            await self.never.wait()
        if callable(step):
            step = await step()
        return web.Response(
            text=step if isinstance(step, str) else json.dumps(step), content_type="application/json", headers={"X-Policy-Version": "v7"},
        )

    async def start(self, port: int = 0) -> "Policy":
        app = web.Application()
        app.router.add_post("/{name}/v1/chat/completions", self._chat)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", port or free_port())
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return self

    async def stop(self) -> None:
        self.never.set()
        if self.runner is not None:
            await self.runner.cleanup()


__all__ = ["Policy", "Script", "answer", "call"]
