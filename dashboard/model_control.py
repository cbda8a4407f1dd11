"""Loading and unloading models by hand: the models page's buttons and ``POST
/api/models/load/{model}``, audited.

* ``POST /api/models/load/{model}`` (ours; llama-swap loads a model by its first request):
  starts the model now, like a preload (a request at priority 0 nobody waits for), even
  during its ``startFailureCooldown``: a Load tries again at once. Answers when it is ready
  (``{"model": id, "state": "ready"}``) or could not start (503 with the cause). With API
  keys required it needs a key granted the ``models`` scope or a staff session
  (``web.access``); another site's page is refused (keys or not).
* ``POST /models/control/`` (the models page, a staff session, the CSRF token):
  ``action`` = ``load`` | ``unload`` | ``unload_all``, ``model``.

Every load and unload asked for here is a :class:`control.models.SettingsChange` row
(field ``model load`` / ``model unload``, new: the model id or ``*``, who), as profile
switches are. The proxy's ``/api/models/unload`` (llama-swap's, for scripts) is unchanged.
"""

from __future__ import annotations

import logging
import uuid

from asgiref.sync import sync_to_async
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views.decorators.csrf import csrf_exempt

from dashboard.access import is_staff
from dashboard.model_watch import watch_of
from scheduler.keys import Scope, missing_scope_message
from scheduler.process import ModelStartError
from scheduler.runtime import Runtime
from scheduler.tickets import Outcome, Refused
from web.errors import cross_origin_refused, echo, error_response
from web.runtime import runtime_of

log = logging.getLogger("llamaswap.models")

LOAD, UNLOAD = "model load", "model unload"
"""The ``SettingsChange.field`` of each act."""
ALL = "*"


class UnknownModel(LookupError):
    pass


def _model_id(rt: Runtime, name: str) -> str:
    model = rt.config.resolve(name)
    if model is None:
        raise UnknownModel(name)
    return model.id


async def load(rt: Runtime, name: str, who: str) -> str | None:
    """Start model ``name`` of ``rt`` now (a name or an alias); returns None once it is
    ready, else the cause it could not start. Raises :class:`UnknownModel`."""
    model = rt.config.resolve(name)
    if model is None:
        raise UnknownModel(name)
    log.info("load asked for", extra={"model": model.id, "who": who})
    await _record(who, LOAD, model.id)
    dispatcher = rt.dispatcher
    ticket = dispatcher.submit(model, 0, f"load-{uuid.uuid4().hex[:12]}", "load")
    ticket.extra["preload"] = True  # a load, not a request: no cool-down, no record
    watch = watch_of(dispatcher.observers)
    try:
        await ticket.wait()
    except ModelStartError as error:
        if watch is not None:
            watch.failed(model.id, error.cause)
        return error.cause
    except Refused as error:
        return str(error)
    finally:
        dispatcher.finish(ticket, Outcome.COMPLETED, 200)
    if watch is not None and ticket.load_seconds is not None:
        watch.loaded(model.id, ticket.load_seconds)
    return None


async def unload(rt: Runtime, name: str | None, who: str) -> None:
    """Stop model ``name`` of ``rt`` (every model when None); returns once the processes
    are gone. Raises :class:`UnknownModel`."""
    models = None if name is None else [_model_id(rt, name)]
    log.info("unload asked for", extra={"model": models[0] if models else ALL, "who": who})
    await _record(who, UNLOAD, models[0] if models else ALL)
    await rt.dispatcher.unload(models)


async def _record(who: str, field: str, model: str) -> None:
    """The audit row; a database that is away costs the row (logged), never the act."""
    try:
        await sync_to_async(_audit, thread_sensitive=True)(who, field, model)
    except Exception:
        log.warning("model %s not recorded in the change log", field, exc_info=True)


def _audit(who: str, field: str, model: str) -> None:
    from control.models import SettingsChange

    SettingsChange.objects.create(
        who=who[:150], field=field, old=None, new=model, source=SettingsChange.SOURCE_ADMIN
    )


async def who_may(request: HttpRequest, via: str) -> tuple[str | None, HttpResponse | None]:
    """Who acts (a key granted ``models``, a staff session, or anyone on an open box),
    or the refusal."""
    key = (getattr(request, "scope", None) or {}).get("llamaswap.api_key")
    if key is not None:
        if not key.allows(Scope.MODELS):  # the router refuses it first; kept beside the act
            message = missing_scope_message(Scope.MODELS, request.path, key.name)
            return None, error_response(403, message, code="insufficient_scope")
        return f"API key {key.name}", None
    user = await request.auser()
    if is_staff(user):
        return f"{user.get_username()} ({via})", None
    if runtime_of(request).keys.enabled:  # not reached: the router asks for a key first
        return None, error_response(
            401, "an API key or a staff login is needed", code="invalid_api_key"
        )
    return f"{via} (no API keys configured)", None


@csrf_exempt  # no session is needed or trusted here: a key, or no keys; cross-site refused
async def load_api(request: HttpRequest, model_name: str) -> HttpResponse:
    """POST /api/models/load/{model}."""
    from web.access import cross_origin

    reason = cross_origin(request)
    if reason is not None:
        return cross_origin_refused(reason)
    who, refusal = await who_may(request, "API")
    if refusal is not None:
        return refusal
    assert who is not None
    rt = runtime_of(request)
    try:
        cause = await load(rt, model_name, who)
    except UnknownModel:
        return error_response(404, f"model {echo(model_name)} not found", code="model_not_found")
    model = _model_id(rt, model_name)
    if cause is not None:
        return error_response(
            503, f"model {echo(model)} could not start: {cause}", code="model_start_failed"
        )
    return JsonResponse({"model": model, "state": "ready"})


async def control(request: HttpRequest) -> HttpResponse:
    """POST /models/control/ (the models page): staff only, CSRF-checked by the pages'
    middleware. JSON answers: ``{"ok": true}`` or an error naming the cause."""
    user = await request.auser()
    if not is_staff(user):
        return error_response(403, "only staff may load or unload models", code="forbidden")
    action, name = request.POST.get("action", ""), request.POST.get("model", "")
    who = f"{user.get_username()} (models page)"
    rt = runtime_of(request)
    try:
        if action == "load":
            cause = await load(rt, name, who)
            if cause is not None:
                return error_response(
                    503, f"{echo(name)} could not start: {cause}", code="model_start_failed"
                )
        elif action == "unload":
            await unload(rt, name, who)
        elif action == "unload_all":
            await unload(rt, None, who)
        else:
            return error_response(
                400, f"unknown action {echo(action)}", code="invalid_action", param="action"
            )
    except UnknownModel:
        return error_response(404, f"model {echo(name)} not found", code="model_not_found")
    return JsonResponse({"ok": True})
