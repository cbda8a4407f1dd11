"""llama-swap's web-UI API: ``/running``'s records, ``GET /api/version``,
``POST /api/inflight/{id}/cancel``, ``GET /api/hardware``, ``GET /api/performance``, and
where its web UI's addresses (``/ui/...``, ``GET /upstream``) lead here.

Thin async views; what they answer is llama-swap's shape (``docs/llama-swap-compat.md``).
"""

from __future__ import annotations

import re
import shlex
from importlib import metadata
from typing import Any

from django.http import HttpRequest, HttpResponse, HttpResponseRedirect, JsonResponse
from django.views.decorators.csrf import csrf_exempt

from proxy import hardware
from scheduler.config import Config, ModelConfig
from scheduler.keys import Scope
from web.access import cross_origin
from web.cancel import cancel_answer, key_of
from web.errors import cross_origin_refused, echo, error_response
from web.runtime import runtime_of

_SECRET_FLAG = re.compile(r"^--?[\w-]*(key|token|secret|passw(or)?d)$", re.IGNORECASE)
"""A command-line flag whose value is a credential (``--api-key``, ``--hf-token``)."""
REDACTED = "***"
PROG = "llamaswap"
"""The distribution's name (``-version`` says the same, llamaswap_site/cli.py)."""


def shown_cmd(model: ModelConfig) -> str:
    """The model's ``cmd`` as ``/running`` shows it: its argv joined shell-style, the value
    of a credential flag (``--api-key K``, ``--hf-token=T``) replaced by ``***``
    (llama-swap shows it whole, to every key that may list the running models)."""
    words: list[str] = []
    hide_next = False
    for word in model.cmd:
        if hide_next:
            words.append(REDACTED)
            hide_next = False
            continue
        flag, eq, _value = word.partition("=")
        if _SECRET_FLAG.match(flag):
            if eq:
                words.append(f"{flag}={REDACTED}")
            else:
                words.append(word)
                hide_next = True
            continue
        words.append(word)
    return shlex.join(words)


def running_record(
    config: Config, model_id: str, state: str, extra: dict[str, Any]
) -> dict[str, Any]:
    """One ``/running`` record: llama-swap's keys (``model``, ``state``, ``cmd``,
    ``proxy``, ``ttl``, ``name``, ``description``) then ours (``lane``)."""
    model = config.models.get(model_id)
    record: dict[str, Any] = {"model": model_id, "state": state}
    if model is not None:
        record.update(
            cmd=shown_cmd(model),
            proxy=model.proxy,
            ttl=model.ttl,
            name=model.name,
            description=model.description,
        )
    record.update(extra)
    return record


async def running(request: HttpRequest) -> HttpResponse:
    """GET /running: every model not stopped, sorted by id, as llama-swap lists them."""
    rt = runtime_of(request)
    records = [
        running_record(
            rt.config,
            entry["model"],
            entry["state"],
            {k: v for k, v in entry.items() if k not in ("model", "state")},
        )
        for entry in rt.dispatcher.running_models()
    ]
    records.sort(key=lambda record: record["model"])
    return JsonResponse({"running": records})


async def version(request: HttpRequest) -> HttpResponse:
    """GET /api/version: llama-swap's keys (``version``, ``commit``, ``build_date``)."""
    try:
        number = metadata.version(PROG)
    except metadata.PackageNotFoundError:
        number = "(not installed)"
    return JsonResponse({"version": number, "commit": PROG, "build_date": "unknown"})


@csrf_exempt
async def cancel_inflight(request: HttpRequest, request_id: str) -> HttpResponse:
    """POST /api/inflight/{id}/cancel: cancel a request waiting or being answered, by the
    id its client got (``X-LlamaSwap-Request-Id``). ``{"msg": "ok"}`` as llama-swap, with
    ``was`` (``waiting`` or ``running``); 404 when no such request is in flight. Never
    from another site's page (it would stop other people's requests)."""
    reason = cross_origin(request)
    if reason is not None:
        return cross_origin_refused(reason)
    key = (getattr(request, "scope", None) or {}).get("llamaswap.api_key")
    by = "api"
    if key is not None:  # a staff session has none: it may cancel any
        by = f"API key {key.name}"
        if not key.allows(Scope.OPERATOR) and key_of(request_id) not in (None, key.name):
            return error_response(
                403,
                f"API key {echo(key.name)} may cancel only the requests it sent "
                "(a key with the operator scope may cancel any)",
                code="insufficient_scope",
            )
    return cancel_answer(request_id, by)[0]


async def hardware_snapshot(request: HttpRequest) -> HttpResponse:
    """GET /api/hardware: llama-swap's machine snapshot (proxy/hardware.py)."""
    return JsonResponse(hardware.snapshot())


async def performance(request: HttpRequest) -> HttpResponse:
    """GET /api/performance: llama-swap's answer when its CPU/GPU sampling is off
    (``503 {"enabled": false}``): llamaswap samples none (docs/llama-swap-compat.md)."""
    response = JsonResponse({"enabled": False}, status=503)
    # The expected answer, not a server error: Django would log every poll as an ERROR.
    response._has_been_logged = True  # type: ignore[attr-defined]
    return response


UI_PAGES = {
    "": "/",
    "models": "/models/",
    "logs": "/dashboard/logs/",
    "activity": "/history/",
    "performance": "/",
}
"""llama-swap's web-UI pages (``/ui/<page>``) -> the dashboard page that shows the same."""


async def ui_redirect(request: HttpRequest, page: str = "") -> HttpResponse:
    """GET /ui/...: a bookmark to llama-swap's web UI lands on the dashboard's page for it
    (302; an unknown page on the dashboard itself)."""
    return HttpResponseRedirect(UI_PAGES.get(page.strip("/"), "/"))


async def upstream_index(request: HttpRequest) -> HttpResponse:
    """GET /upstream: 302 to ``/ui/models``, as llama-swap (which leads to the models page)."""
    return HttpResponseRedirect("/ui/models")
