"""The model gateway: ``POST /rollouts/<job>/v1/chat/completions`` is an OpenAI-compatible endpoint
per rollout. The request goes (as the caller's NATS identity) to the rollout workers, which forward
it to the job's policy and log request and response, token ids and logprobs included when the
backend returns them, in the job's sandbox trajectory beside its steps (sdk/rollouts/_worker)."""

from __future__ import annotations

from typing import Any

import nats.errors
from aiohttp import web

from bus import codec
from bus import subjects as S
from bus.errors import DsecError
from bus.messages import ModelAnswer, ModelCall
from bus.runtime import tenant_of

REQUEST_TIMEOUT_S = 600.0  # the workers answer within the job's policy timeout; this only bounds a lost reply


def _error(status: int, code: str, message: str) -> web.Response:
    """An OpenAI-style error body, with dsec's stable code as its type."""
    return web.json_response({"error": {"message": message, "type": code, "code": code}}, status=status)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    from ._app import GATEWAY_KEY

    job = request.match_info["job"]
    if not S.valid_token(job):
        return _error(400, "invalid_argument", f"not a job id: {job!r}")
    tenant, _ = await request.app[GATEWAY_KEY].tenant(request)
    body = await request.read()
    try:
        # under the key's own tenant: the workers answer a tenant about its own jobs only
        msg = await tenant.nc.request(S.model_call(job, tenant_of(tenant.nc)), codec.encode(ModelCall(job_id=job, body=body)), timeout=REQUEST_TIMEOUT_S)
    except nats.errors.NoRespondersError:
        return _error(503, "unavailable", "no rollout worker is running")
    except nats.errors.TimeoutError:
        return _error(504, "policy_timeout", "no answer from the rollout workers")
    try:
        ans: ModelAnswer = codec.decode_reply(msg.data, ModelAnswer)
    except DsecError as exc:
        return _error(exc.http_status, exc.code, exc.description)
    headers = {"X-Policy-Version": ans.policy_version} if ans.policy_version else None
    return web.Response(body=ans.body, status=ans.status, content_type="application/json", headers=headers)


def add_routes(app: web.Application) -> Any:
    app.router.add_post("/rollouts/{job}/v1/chat/completions", chat_completions)


__all__ = ["add_routes", "chat_completions"]
