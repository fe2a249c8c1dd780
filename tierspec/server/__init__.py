"""An OpenAI-compatible HTTP server: ``tierspec serve``.

Endpoints: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions`` (the
model's chat template applied), ``GET /health``. ``stream: true`` answers with server-sent
events in OpenAI's chunk format. Beside OpenAI's fields a request may carry ``method`` (any
tierspec method, overriding the one chosen at start-up), ``top_k`` and ``num_draft``; the
``usage`` object carries the speculative statistics next to the token counts.

How a request flows, one module per step:

    app.py      handler (event loop)   read the body (≤ max_request_bytes, else 413)
    parsing.py  prepare (a thread)     parse the JSON, validate strictly, tokenise, check the context
    scheduler.py  Scheduler.submit     queue the job, or 503 when the queue is full
                the worker thread      one executor: the batch's cycles over every admitted
                                       generation; typed events back to the handler: Started,
                                       TextPiece…, ChoiceDone…, Finished | Failed
    app.py      the endpoint's format  one JSON response, or one SSE chunk per event

A client that leaves cancels its request: a waiting one leaves the queue at once, a running
one stops at its next cycle. On shutdown (SIGTERM, SIGINT) the server stops accepting, turns
waiting requests away with 503 and stops the running ones at their next cycle with a
well-formed ending. Every error answers with OpenAI's body,
``{"error": {"message", "type", "param", "code"}}``.
"""

from .app import DEFAULT_MAX_REQUEST_BYTES, create_app, listen, serve, serving_in_background, settle_heap
from .scheduler import ApiError, Scheduler, StopMatcher

__all__ = ["DEFAULT_MAX_REQUEST_BYTES", "ApiError", "Scheduler", "StopMatcher", "create_app", "listen", "serve",
           "serving_in_background", "settle_heap"]
