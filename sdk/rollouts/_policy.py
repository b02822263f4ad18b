"""Talking to the policy: one OpenAI-compatible chat-completions request per turn, its answer checked.

An unreachable policy (connection refused, 5xx, 429: a preempted GPU pool) is waited for with
back-off up to the job's ``policy_wait_s``; three requests in a row that time out are a
``policy_timeout``; an answer that cannot be acted on (not JSON, no message, an unknown tool,
arguments of the wrong type) is a ``policy_error``. Each is recorded in the job.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp

from bus.errors import PolicyError, PolicyTimeout

TIMEOUTS_IN_A_ROW = 3
BACKOFF_START_S = 0.2
BACKOFF_CAP_S = 5.0

# name -> (description, {argument: (JSON type, python types, required)})
TOOLS: dict[str, tuple[str, dict[str, tuple[str, tuple[type, ...], bool]]]] = {
    "exec": ("Run a shell command in the sandbox; returns exit code, stdout and stderr.",
             {"cmd": ("string", (str,), True), "timeout": ("number", (int, float), False)}),
    "read_file": ("Read a text file of the sandbox.", {"path": ("string", (str,), True)}),
    "write_file": ("Write a text file in the sandbox.", {"path": ("string", (str,), True), "content": ("string", (str,), True)}),
}


POLICY_VERSION_HEADERS = ("X-Policy-Version", "X-Model-Version")  # what an endpoint may say of its weights


@dataclass
class Completion:
    """One answered policy request: the assistant message acted on and what went over the wire."""

    message: dict[str, Any]
    request: dict[str, Any]
    response: str  # the body as received (token ids and logprobs in it when the backend returns them)
    policy_version: str
    started_at: float
    duration_ms: float


class Stopping(Exception):
    """The worker is shutting down while the job waits: left un-acked for another worker."""


def tool_schemas(names: list[str]) -> list[dict[str, Any]]:
    out = []
    for n in names:
        desc, args = TOOLS[n]
        out.append({"type": "function", "function": {
            "name": n, "description": desc,
            "parameters": {
                "type": "object", "properties": {a: {"type": t} for a, (t, _, _) in args.items()},
                "required": [a for a, (_, _, req) in args.items() if req],
            },
        }})
    return out


def chat_url(policy_url: str) -> str:
    url = policy_url.rstrip("/")
    return url if url.endswith("/chat/completions") else url + "/chat/completions"


def parse_reply(text: str, tools: list[str]) -> dict[str, Any]:
    """The assistant message of a chat-completions answer, its tool calls checked against ``tools``."""
    try:
        body = json.loads(text)
    except ValueError:
        raise PolicyError(f"the policy's answer is not JSON: {text[:200]!r}") from None
    try:
        msg = body["choices"][0]["message"]
    except (KeyError, IndexError, TypeError):
        raise PolicyError(f"the policy's answer has no choices[0].message: {text[:200]!r}") from None
    if not isinstance(msg, dict):
        raise PolicyError("choices[0].message is not an object")
    content = msg.get("content")
    if content is not None and not isinstance(content, str):
        raise PolicyError(f"the message's content must be a string or null, got {type(content).__name__}")
    calls = msg.get("tool_calls") or []
    if not isinstance(calls, list):
        raise PolicyError("tool_calls must be a list")
    out_calls = [_parse_call(n, c, tools) for n, c in enumerate(calls)]
    out: dict[str, Any] = {"role": "assistant", "content": content}
    if out_calls:
        out["tool_calls"] = out_calls
    return out


def _parse_call(n: int, c: Any, tools: list[str]) -> dict[str, Any]:
    fn = c.get("function") if isinstance(c, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise PolicyError(f"tool call {n} has no function name")
    name = fn["name"]
    if name not in tools:
        raise PolicyError(f"tool call {n} names an unknown tool {name!r} (this job's tools: {', '.join(tools)})", tool=name)
    raw = fn.get("arguments", "{}")
    try:
        args = json.loads(raw) if isinstance(raw, str) else raw
    except ValueError:
        raise PolicyError(f"the arguments of tool call {n} ({name}) are not JSON: {str(raw)[:200]!r}", tool=name) from None
    if not isinstance(args, dict):
        raise PolicyError(f"the arguments of tool call {n} ({name}) are not an object", tool=name)
    for a, (jtype, types, required) in TOOLS[name][1].items():
        if a not in args:
            if required:
                raise PolicyError(f"tool call {n} ({name}) lacks the argument {a!r}", tool=name)
            continue
        if isinstance(args[a], bool) or not isinstance(args[a], types):
            raise PolicyError(f"argument {a!r} of tool call {n} ({name}) must be a {jtype}, got {type(args[a]).__name__}", tool=name)
    call_id = c.get("id") if isinstance(c.get("id"), str) and c.get("id") else f"call_{n}"
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}


async def ask(
    session: aiohttp.ClientSession, *, policy_url: str, model: str, messages: list[dict[str, Any]], tools: list[str],
    timeout_s: float, wait_s: float, on_wait: Callable[[str], Awaitable[None]], pause: Callable[[float], Awaitable[bool]],
) -> Completion:
    """The policy's next assistant message. ``on_wait(why)`` runs before each back-off; ``pause(s)``
    sleeps (True: the worker is stopping, and the job is left for another one)."""
    body = {"model": model or "policy", "messages": list(messages), "tools": tool_schemas(tools)}  # as sent (the job goes on appending)
    deadline = time.monotonic() + wait_s
    delay, timeouts = BACKOFF_START_S, 0
    url = chat_url(policy_url)
    while True:
        started, t0 = time.time(), time.perf_counter()
        try:
            async with session.post(url, json=body, timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
                text = await r.text()
                if r.status == 429 or r.status >= 500:
                    why = f"HTTP {r.status}"
                elif r.status >= 400:
                    raise PolicyError(f"the policy refused the request: HTTP {r.status} {text[:200]!r}", status=r.status)
                else:
                    version = next((r.headers[h] for h in POLICY_VERSION_HEADERS if h in r.headers), "")
                    return Completion(parse_reply(text, tools), body, text, version, started, (time.perf_counter() - t0) * 1000)
            timeouts = 0
        except asyncio.TimeoutError:
            timeouts += 1
            if timeouts >= TIMEOUTS_IN_A_ROW:
                raise PolicyTimeout(f"the policy did not answer within {timeout_s:g}s, {timeouts} times in a row") from None
            why = f"no answer within {timeout_s:g}s"
        except aiohttp.ClientError as exc:
            why = f"{type(exc).__name__}: {exc}"
        if time.monotonic() + delay > deadline:
            raise PolicyTimeout(f"the policy was unreachable for {wait_s:g}s ({why})")
        await on_wait(why)
        if await pause(delay):
            raise Stopping
        delay = min(delay * 2, BACKOFF_CAP_S)


__all__ = ["Completion", "Stopping", "TOOLS", "tool_schemas", "chat_url", "parse_reply", "ask"]
