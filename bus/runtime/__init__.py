"""The runtime: the only code in dsec that touches nats-py mechanics or ``$JS.``/``$KV.`` subjects.

Services build on these pieces (a test, tests/unit/test_runtime_rule.py, keeps it that way):

``connect(url, name=...)`` / ``nats_url()``
    Bounded first connect, the user's inbox prefix (bus.auth), one-line error logs.
``Service``
    ``setup()``/``teardown()`` hooks, ``run()`` until SIGTERM, ``shutdown()``: stop intake, finish
    in-flight work (grace), tear down, drain. ``self.nc``, ``self.js``, ``self.publisher``;
    ``await self.add_worker(stream=, durable=, filter_subject=, capacity=, handler= | on_batch=, ...)``
    starts a ``PullConsumer`` that shutdown stops; ``add_inbox(subject, handler, capacity=)`` a
    ``HandoffInbox``, stopped the same way.
``PullConsumer(nc, stream=, config=consumer_config(...), capacity=, handler= | on_batch=, inbox=)``
    Credit-based: asks for exactly its free capacity (reserved before the pull), per-message tasks
    or whole batches; a handler that raises leaves the message un-acked (JetStream redelivers).
    ``PullInbox(nc)`` lets thousands of consumers share one subscription.
``Publisher`` / ``publisher_for(nc)``
    ``fut = await p.publish(subject, data, headers)`` (pipelined) or ``ack = await p.store(...)``;
    answers decode to ``PubAck(stream, seq, duplicate)``; refusals raise ``StoreError`` (``err_code``);
    at most ``max_inflight`` unanswered writes.
``KV.open(js, bucket, Type)``
    ``get``/``entry`` (missing or undecodable -> None, logged and counted), ``put``/``put_async``,
    ``create``/``update(last=)`` (False when beaten), ``delete``, ``keys``, and one compare-and-set
    ``claim(key, value, mine=)`` -> ``Claim.WON``/``MINE``/``LOST`` (an undecodable record is
    treated as absent); ``await kv.watch(on_put(key, value, rev), on_delete(key))`` -> ``Watch``
    (``.synced``, ``.stop()``). ``kv_keys(js, bucket)``; ``kv_erase(js, bucket, key)``.
``Endpoint(nc, name, handler, decoder=Decoder | {op: Decoder})``
    ``await ep.serve(subject, queue=)``; ``handler(msg, request) -> Struct``; one error boundary
    (DsecError -> its ErrorReply, anything else -> ``internal``; a reply over max_payload ->
    ``reply_too_large``); ``ep.stats`` (requests, errors, processing time, last error).
    ``subscribe_sync(nc, subject, fn)``: a subscription without a task of its own.
``Events(nc, publisher, host_id=)``
    ``await ev.sandbox(spec, kind, attempt=, err=, detail=, acked=, wait=)``: msg-id
    ``<id>:<kind>:<attempt>`` and the reply fan-out to the creating client's inbox; ``ev.host(...)``;
    ``best_effort_event(js, subject, struct)`` for events that must never fail the work.
``service.metrics`` (a ``bus.metrics.Registry``) / ``scrape_all(nc)`` / ``scrape_one(nc, service, instance)``
    Every started Service answers ``dsec.metrics.scrape`` and ``dsec.metrics.<service>.<instance>``
    with its Prometheus text (and serves HTTP on ``service.metrics_port`` when set); consumer pending
    counts, endpoint stats and process usage are added to every registry (``bus.runtime.metrics``).
``Handoffs(nc)`` / ``HandoffInbox(nc, subject, handler, capacity=)``
    Work handed to one taker on a core subject, answered on its reply subject (done, working,
    refused); the giver holds the JetStream request un-acked until ``done`` (bus.runtime.handoff).
``dead_letter(publisher, msg, code, description)``
    Keep malformed work on DSEC_DLQ with ``Dsec-Error-Code``/``Dsec-Error``/``Dsec-Origin``, then ack.
"""

from .connection import DEFAULT_URL, connect, connection_of, nats_url, reads_records, tenant_of
from .consumer import BatchHandler, Handler, PullConsumer, PullInbox, consumer_config, deliveries
from .deadletter import dead_letter, dead_letter_headers
from .endpoint import Endpoint, EndpointStats, NotMine, error_of
from .handoff import HandoffInbox, Handoffs
from .events import (
    ONCE_PER_ATTEMPT, REPLY_KINDS, Events, LookupFailed, ReadyScan, best_effort_event, event_msg_id, find_ready_many, own_ready_since, ready_many_msg_id,
    sandbox_event,
)
from .kv import KV, Claim, Versioned, Watch, kv_erase, kv_keys
from .publisher import (
    ERR_WRONG_LAST_SEQUENCE, PubAck, Publisher, StoreError, decode_puback, nc_of, no_responders,
    publisher_for, release_publisher, subscribe_sync, unsubscribe_quietly,
)
from .metrics import Exposition, consumer_collector, endpoint_collector, expose, instance_of, scrape_all, scrape_one, stream_collector
from .service import Service

__all__ = [
    "DEFAULT_URL",
    "connect",
    "nats_url",
    "connection_of",
    "reads_records",
    "tenant_of",
    "BatchHandler",
    "Handler",
    "PullConsumer",
    "PullInbox",
    "consumer_config",
    "deliveries",
    "dead_letter",
    "dead_letter_headers",
    "Endpoint",
    "EndpointStats",
    "NotMine",
    "error_of",
    "HandoffInbox",
    "Handoffs",
    "ONCE_PER_ATTEMPT",
    "REPLY_KINDS",
    "Events",
    "LookupFailed",
    "ReadyScan",
    "best_effort_event",
    "event_msg_id",
    "find_ready_many",
    "own_ready_since",
    "ready_many_msg_id",
    "sandbox_event",
    "KV",
    "Claim",
    "Versioned",
    "Watch",
    "kv_erase",
    "kv_keys",
    "ERR_WRONG_LAST_SEQUENCE",
    "PubAck",
    "Publisher",
    "StoreError",
    "no_responders",
    "decode_puback",
    "nc_of",
    "publisher_for",
    "release_publisher",
    "subscribe_sync",
    "unsubscribe_quietly",
    "Service",
    "Exposition",
    "consumer_collector",
    "endpoint_collector",
    "expose",
    "instance_of",
    "scrape_all",
    "scrape_one",
    "stream_collector",
]
