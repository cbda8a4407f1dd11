"""OpenAI-compatible endpoints: parse, wait for the dispatcher's grant, relay.

Thin async views. They run under :class:`llamaswap_site.asgi.ProxyHandler` (no middleware,
no thread hops), so nothing here may block or touch the database.
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Any
from urllib.parse import quote

import httpx
from django.conf import settings
from django.core.exceptions import RequestDataTooBig, TooManyFieldsSent, TooManyFilesSent
from django.core.files.uploadhandler import FileUploadHandler, SkipFile
from django.http import HttpRequest, HttpResponse, HttpResponseBase, JsonResponse
from django.http.multipartparser import MultiPartParserError
from django.views.decorators.csrf import csrf_exempt

from fleet import placing
from proxy import inflight, passthrough, peers, progress, routing
from proxy.passthrough import path_allowed
from proxy.relay import relay
from proxy.turn import RECORD_EXTRA
from scheduler.config import Capabilities, ModelConfig
from scheduler.names import Unroutable
from scheduler.process import ModelState
from web.access import cross_origin
from web.errors import clip, cross_origin_refused, echo, error_response, method_not_allowed
from web.paths import inference_methods, upstream_path
from web.runtime import runtime_of

log = logging.getLogger("llamaswap.proxy")


def new_request_id() -> str:
    """``uuid.uuid4().hex`` without building a UUID object (under half the cost): the same
    32 hex digits with the same version (4) and variant (RFC 4122) bits."""
    n = int.from_bytes(os.urandom(16), "big")
    n = (n & ~(0xF000 << 64)) | (4 << 76)
    n = (n & ~(0xC000 << 48)) | (0x8000 << 48)
    return f"{n:032x}"


# -- inference ---------------------------------------------------------------------------


@csrf_exempt
async def inference(request: HttpRequest) -> HttpResponseBase:
    """POST /v1/chat/completions and friends: the model comes from the body.

    The name goes through the active profile's pin and a selector before the request is
    queued (proxy/routing.py): the dispatcher sees the model that runs it. A peer's model
    is forwarded at once and takes no turn here (proxy/peers.py).
    """
    request_id = new_request_id()
    methods = inference_methods(request.path)
    if request.method not in methods:
        return method_not_allowed(request, methods, request_id=request_id)
    rt = runtime_of(request)
    ceiling = rt.config.global_concurrency_limit
    if ceiling and not inflight.enter(ceiling):
        return error_response(
            429,
            f"too many requests in the server (globalConcurrencyLimit: {ceiling})",
            code="global_concurrency_limit",
            request_id=request_id,
            headers={"Retry-After": "1"},
        )
    if request.method == "GET":  # /props, /sdapi/v1/loras, /v1/audio/voices: ?model=
        parsed: tuple[bytes, dict[str, Any] | None, object] | HttpResponseBase = (
            b"",
            None,
            request.GET.get("model", ""),
        )
    else:
        parsed = _parse_body(request, request_id, rt.config.limits.max_json_values)
    if isinstance(parsed, HttpResponseBase):
        return parsed
    body, data, name = parsed
    del parsed  # it holds the parsed JSON, which must not live while the request waits
    if not isinstance(name, str):
        return error_response(
            400,
            f"'model' must be a string, got {type(name).__name__}",
            code="missing_model",
            request_id=request_id,
            param="model",
        )
    if not name:
        return error_response(
            400,
            "missing 'model' in request",
            code="missing_model",
            request_id=request_id,
            param="model",
        )
    try:
        target = routing.resolve(rt, name)
    except Unroutable as exc:
        return error_response(
            exc.status,
            f"model {echo(name)} not found" + (f": {exc.why}" if exc.why else ""),
            code="model_not_found" if exc.status == 404 else "no_target_available",
            request_id=request_id,
        )
    show_progress = target.model is not None and progress.wanted(target.model, request.path, data)
    if data is not None:
        try:
            if target.peer is not None:
                body = routing.rewrite_peer(data, target)
            else:
                body = routing.rewrite_local(data, body, target)
        except RecursionError:  # what the parser took, at the edge of the stack limit
            return error_response(
                400, "request body is nested too deeply", code="invalid_json", request_id=request_id
            )
        data = None  # not kept alive while the request waits for its turn
    elif request.method == "POST":  # multipart: only the model field changes, as llama-swap does
        field = routing.multipart_model(target)
        if field is not None:
            boundary = (request.content_params or {})["boundary"]  # checked by _parse_body
            body = routing.rewrite_multipart_model(body, boundary, field)
    extra = routing.record_extra(target)
    # fleet: another node starts it sooner (None: it runs here, maybe after a node went away)
    forwarded = await placing.run(
        request,
        target,
        extra,
        lambda route, ex: peers.forward(request, route, request_id, body, ex),
    )
    if forwarded is not None:
        return forwarded
    if target.peer is not None:
        return await peers.forward(request, target, request_id, body, extra)
    assert target.model is not None
    if extra:
        RECORD_EXTRA.set(extra)  # this request's task only (see proxy/turn.py)
    path = upstream_path(request.path)  # /v/... and /audioapi/... without the prefix
    if not target.selector:
        return await relay(request, target.model, request_id, path, body, show_progress)
    with routing.reserved(target):  # until its turn came (relay returns once it has)
        return await relay(request, target.model, request_id, path, body, show_progress)


def _parse_body(
    request: HttpRequest, request_id: str, limit: int
) -> tuple[bytes, dict[str, Any] | None, object] | HttpResponse:
    """The body, its JSON object (None for multipart) and its ``model``; or the 4xx to answer.

    Every way Django or the JSON parser can refuse a body becomes a JSON 4xx naming the
    problem (Django's own would be an HTML 400 page; a too-deep JSON a 500).

    Both parsers run on the event loop (``json.loads`` holds the GIL: a thread would not
    free it), so their cost is bounded before they start: a JSON body may hold at most
    ``limit`` values (``limits.maxJsonValues``: :func:`_json_values_bound`; a body of ``{},`` cost
    25x its size and 0.9 s per 30 MB), and a multipart body's files are skipped, not
    stored (only its ``model`` field is read; Django keeps fields within
    ``DATA_UPLOAD_MAX_MEMORY_SIZE``, ``DATA_UPLOAD_MAX_NUMBER_FIELDS`` and ``_FILES``).
    """

    def refuse(status: int, message: str, code: str) -> HttpResponse:
        return error_response(status, message, code=code, request_id=request_id)

    try:
        body = request.body
    except RequestDataTooBig:
        return refuse(
            413,
            f"request body is over {settings.DATA_UPLOAD_MAX_MEMORY_SIZE} bytes",
            "request_too_large",
        )
    if request.content_type == "multipart/form-data":
        if not (request.content_params or {}).get("boundary"):
            return refuse(
                400, "multipart/form-data without a boundary in Content-Type", "invalid_multipart"
            )
        if not request.META.get("CONTENT_LENGTH"):
            # Sent chunked: Django's parser reads nothing without a length (the body is here).
            request.META["CONTENT_LENGTH"] = str(len(body))
        # The raw body goes upstream: the files' bytes are passed over, not written to a
        # temporary file on the event loop's thread (Django's default beyond 2.5 MB).
        request.upload_handlers = [_SkipFiles(request)]
        try:
            name = request.POST.get("model", "")
        except TooManyFieldsSent:
            return refuse(
                400,
                f"multipart body has more than {settings.DATA_UPLOAD_MAX_NUMBER_FIELDS} fields",
                "too_many_fields",
            )
        except TooManyFilesSent:
            return refuse(
                400,
                f"multipart body has more than {settings.DATA_UPLOAD_MAX_NUMBER_FILES} files",
                "too_many_files",
            )
        except RequestDataTooBig:
            return refuse(
                413,
                f"multipart fields are over {settings.DATA_UPLOAD_MAX_MEMORY_SIZE} bytes",
                "request_too_large",
            )
        except MultiPartParserError as exc:
            return refuse(
                400, f"multipart body could not be read: {clip(str(exc))}", "invalid_multipart"
            )
        return body, None, name
    if not body.strip():
        return refuse(400, "request body is empty: expected a JSON object", "invalid_json")
    values = _json_values_bound(body, limit)
    if values > limit:
        return refuse(
            413,
            f"request body has up to {values} JSON values (its {{ [ , : bytes, counted before "
            f"parsing), over the limit of {limit} (limits.maxJsonValues)",
            "request_too_large",
        )
    try:
        data = json.loads(body)
    except RecursionError:
        return refuse(400, "request body is not valid JSON: nested too deeply", "invalid_json")
    except (ValueError, UnicodeDecodeError) as exc:
        return refuse(400, f"request body is not valid JSON: {clip(str(exc))}", "invalid_json")
    if not isinstance(data, dict):
        return refuse(
            400, f"request body must be a JSON object, got {_json_type(data)}", "invalid_json"
        )
    return body, data, data.get("model", "")


_STRUCTURAL = (b",", b":", b"{", b"[")


def _json_values_bound(body: bytes, limit: int) -> int:
    """An upper bound on the number of values (object keys included) in the JSON ``body``,
    exact enough once it passes ``limit``: every value but the outermost follows one of
    ``, : { [`` (those inside strings are counted too). ``bytes.count`` runs at memory
    speed (~0.1 s for 256 MB on one core); a body shorter than ``limit`` is not scanned."""
    if len(body) < limit:
        return len(body)
    total = 1
    for byte in _STRUCTURAL:
        total += body.count(byte)
        if total > limit:
            break
    return total


class _SkipFiles(FileUploadHandler):
    """An upload handler that passes over every file of a multipart body unread."""

    def new_file(self, *args: Any, **kwargs: Any) -> None:
        raise SkipFile()

    def receive_data_chunk(self, raw_data: bytes, start: int) -> bytes | None:
        return None

    def file_complete(self, file_size: int) -> None:
        return None


def _json_type(value: object) -> str:
    return {list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(value), "a number"
    )


@csrf_exempt
async def upstream_passthrough(request: HttpRequest, rest: str) -> HttpResponseBase:
    """ANY /upstream/{model}/{path}: the model from the path, everything else as sent.

    The model is the longest leading run of path segments that names one (llama-swap's
    rule: ids with ``/``, Hugging Face style, work, also sent as ``%2F``). ``/upstream/{model}``
    without the trailing slash is redirected to it, as llama-swap does (301 for GET and
    HEAD, 308 otherwise), so relative links in a model's web UI resolve. Local models only.
    The active profile's pin applies (to a local target); selectors do not, as in
    llama-swap (proxy/passthrough.py: the same rule for websockets).
    """
    request_id = new_request_id()
    rt = runtime_of(request)
    found = passthrough.find(rt, rest)
    if found is None:
        first = rest.split("/", 1)[0]
        return error_response(
            404, f"model {echo(first)} not found", code="model_not_found", request_id=request_id
        )
    model_name, path, model = found
    if path is None:  # /upstream/{model}: to /upstream/{model}/
        return passthrough.slash_redirect(
            request, "/upstream/" + quote(model_name, safe=passthrough.PATH_SAFE)
        )
    if model is None:
        return error_response(
            404,
            f"model {echo(model_name)} not found",
            code="model_not_found",
            request_id=request_id,
        )
    raw_rest = passthrough.raw_rest(getattr(request, "scope", None), model_name, path)
    if not path_allowed("/" + path, rt.config.upstream_allow_paths):
        refusal = _path_refusal(model, path, raw_rest, request_id)
        if refusal is not None:
            return refusal
    # upstream.ignorePaths (llama-swap's rule): a matching path (decoded, after the model)
    # never loads the model. Unless it is loaded and ready it is refused here, before any
    # turn is taken.
    if passthrough.ignored("/" + path, rt.config.upstream_ignore_paths) and (
        routing.model_states(rt.dispatcher).get(model.id) is not ModelState.READY
    ):
        return error_response(
            409,
            f"model {model.id} is not loaded; path matches upstream.ignorePaths",
            code="model_not_loaded",
            request_id=request_id,
        )
    if model_name != model.id:
        RECORD_EXTRA.set({"requested_model": model_name})  # an alias or a pin
    return await relay(request, model, request_id, raw_rest, request.body)


def _path_refusal(
    model: ModelConfig, path: str, raw_rest: str, request_id: str
) -> HttpResponse | None:
    """403 for a path ``upstream.allowPaths`` does not name (the model's operator endpoints:
    ``/slots``, ``/metrics``, ...), before any turn is taken. None for a path that is no
    URL at all: the relay answers that one with 400 ``invalid_path``."""
    try:
        httpx.URL(model.proxy.rstrip("/") + raw_rest)
    except (httpx.InvalidURL, ValueError):
        return None
    return error_response(
        403,
        f"/upstream/{model.id}/ may not reach {echo('/' + path)}: not in upstream.allowPaths",
        code="path_not_allowed",
        request_id=request_id,
    )


# -- not scheduled -----------------------------------------------------------------------


STARTED_AT = int(time.time())
"""When the server started (this module is imported as the URLconf loads, before daphne
serves): the config file was loaded then, and /v1/models gives it as each model's
``created``."""


async def list_models(request: HttpRequest) -> HttpResponse:
    """GET /v1/models: OpenAI's list, with llama-swap's additions, sorted by id.

    ``unlisted`` models are hidden. ``created`` is the server's start (when the config file
    was loaded), in Unix seconds. As llama-swap: ``status.value`` is loaded or unloaded;
    ``capabilities`` add ``architecture``, ``capabilities``, ``supported_parameters`` and
    ``context_length`` (and ``meta.n_ctx``); ``meta.llamaswap`` is the model's
    ``metadata`` plus ``type`` (model or alias) and ``aliases`` / ``modelID``; with
    ``includeAliasesInList`` each alias is a record of its own. Then, as llama-swap: each
    peer model as ``peer/model`` (``type: peer``), each selector not ``unlisted``
    (``type: selector``, loaded when a target it would pick is), and the active profile's
    pins that name something not listed otherwise (``type: profile``).
    """
    rt = runtime_of(request)
    config = rt.config
    states = routing.model_states(rt.dispatcher)
    data = []
    for model in config.models.values():
        if model.unlisted:
            continue
        status = "loaded" if model.id in states else "unloaded"
        internal: dict[str, Any] = {"type": "model"}
        if model.aliases:
            internal["aliases"] = list(model.aliases)
        data.append(_model_record(model.id, model, status, internal))
        if config.include_aliases_in_list:
            for alias in model.aliases:
                if alias.strip():
                    data.append(
                        _model_record(
                            alias.strip(), model, status, {"type": "alias", "modelID": model.id}
                        )
                    )
    for record_id, extra in routing.listing_extras(config, rt.profile, states, set(config.models)):
        data.append(_extra_record(record_id, extra))
    data.sort(key=lambda record: record["id"])
    return JsonResponse({"object": "list", "data": data})


_CAPPED_METADATA = frozenset(
    {"architecture", "capabilities", "supported_parameters", "context_length"}
)
"""Record fields the capabilities own: metadata keys of these names are dropped when the
model has capabilities (llama-swap's rule)."""


OWNED_BY = "llama-swap"
"""``owned_by`` of every ``/v1/models`` record: llama-swap's word, which clients show."""


def _model_record(
    record_id: str, model: ModelConfig, status: str, internal: dict[str, Any]
) -> dict[str, Any]:
    record: dict[str, Any] = {
        "id": record_id,
        "object": "model",
        "created": STARTED_AT,
        "owned_by": OWNED_BY,
    }
    if model.name.strip():
        record["name"] = model.name.strip()
    if model.description.strip():
        record["description"] = model.description.strip()
    caps = model.capabilities
    record.update(render_capabilities(caps))
    metadata: dict[str, Any] = dict(model.metadata)
    if not caps.empty:
        metadata = {k: v for k, v in metadata.items() if k not in _CAPPED_METADATA}
    meta: dict[str, Any] = {"llamaswap": {**metadata, **internal}}
    if caps.context > 0:
        meta["n_ctx"] = caps.context
    record["meta"] = meta
    record["status"] = {"value": status}
    return record


def _extra_record(record_id: str, extra: dict[str, Any]) -> dict[str, Any]:
    """A peer, selector or profile record (no capabilities: llama-swap gives them none)."""
    record: dict[str, Any] = {
        "id": record_id,
        "object": "model",
        "created": STARTED_AT,
        "owned_by": OWNED_BY,
    }
    for name in ("name", "description"):
        text = str(extra.get(name) or "").strip()
        if text:
            record[name] = text
    record["meta"] = {"llamaswap": {**extra.get("metadata", {}), **extra["internal"]}}
    record["status"] = {"value": extra["status"]}
    return record


def render_capabilities(caps: Capabilities) -> dict[str, Any]:
    """The fields llama-swap derives from ``capabilities`` (none when it is empty)."""
    fields: dict[str, Any] = {}
    has_in, has_out = bool(caps.inputs), bool(caps.outputs)
    architecture: dict[str, Any] = {}
    if has_in:
        architecture["input_modalities"] = list(caps.inputs)
    if has_out:
        architecture["output_modalities"] = list(caps.outputs)
    if has_in and has_out:
        architecture["modality"] = "+".join(caps.inputs) + "->" + "+".join(caps.outputs)
    if architecture:
        fields["architecture"] = architecture
    flags: dict[str, bool] = {}
    if "image" in caps.inputs:
        flags["vision"] = True
    if has_in and has_out:
        if "audio" in caps.inputs and "text" in caps.outputs:
            flags["audio_transcriptions"] = True
        if "text" in caps.inputs and "audio" in caps.outputs:
            flags["audio_speech"] = True
        if "text" in caps.inputs and "image" in caps.outputs:
            flags["image_generation"] = True
        if "image" in caps.inputs and "image" in caps.outputs:
            flags["image_to_image"] = True
    if caps.tools:
        flags["function_calling"] = True
        fields["supported_parameters"] = ["tools", "tool_choice"]
    if caps.reranker:
        flags["reranker"] = True
    if flags:
        fields["capabilities"] = flags
    if caps.context > 0:
        fields["context_length"] = caps.context
    return fields


@csrf_exempt
async def unload(request: HttpRequest, model_name: str | None = None) -> HttpResponse:
    """GET /unload, POST /api/models/unload[/{model}]: returns once the processes are gone.

    Never from another site's page (keys or not): a browser on the operator's machine
    reaches localhost, so a page could otherwise stop the models (:func:`cross_origin`).
    """
    reason = cross_origin(request)
    if reason is not None:
        return cross_origin_refused(reason)
    rt = runtime_of(request)
    models = None
    if model_name is not None:
        model = rt.config.resolve(model_name)
        if model is None:
            return error_response(
                404, f"model {echo(model_name)} not found", code="model_not_found"
            )
        models = [model.id]
    await rt.dispatcher.unload(models)
    if models is not None or request.path == "/unload":  # llama-swap's answers: "OK" here
        return HttpResponse("OK", content_type="text/plain")
    return JsonResponse({"msg": "ok"})


async def queue(request: HttpRequest) -> HttpResponse:
    """GET /api/queue: the waiting requests in dispatch order, with their scores now.

    With several lanes (GPUs) each lane has its own order: ``waiting`` lists them merged by
    score, each with its ``lane`` and its ``position`` in that lane (1 goes next there).
    ``estimated_wait_seconds``: until it is picked, from the measured times (see
    :meth:`Dispatcher.waiting`)."""
    dispatcher = runtime_of(request).dispatcher
    raw = request.GET.get("limit", "100")
    try:
        limit = max(1, min(int(raw), 1000))
    except ValueError:
        return error_response(
            400,
            f"limit must be an integer 1..1000, got {echo(raw)}",
            code="invalid_limit",
            param="limit",
        )
    now = dispatcher.now()
    model, state = dispatcher.model_state()
    where = dispatcher.waiting(limit)  # lane, position in it, estimated wait
    waiting = [
        {
            "request_id": r.request.request_id,
            "model": r.request.model,
            "lane": where[r.request.request_id][0],
            "position": where[r.request.request_id][1],
            "estimated_wait_seconds": round(where[r.request.request_id][2], 1),
            "priority": r.request.priority,
            "band": r.request.band.value,
            "score": r.score,
            "affinity": r.affinity,
            "aging": r.aging,
            "wait_seconds": r.wait,
        }
        for r in dispatcher.queue.peek(now, limit)
    ]
    running = [
        {
            "request_id": t.request_id,
            "model": t.model.id,
            "lane": t.lane,
            "priority": t.priority,
            "state": t.state.value,
        }
        for t in dispatcher.in_flight()
    ]
    return JsonResponse(
        {
            "depth": len(dispatcher.queue),
            "waiting": waiting,
            "running": running,
            "loaded_model": model,
            "model_state": state.name.lower(),
            "lanes": [
                {
                    "lane": lane.name,
                    "models": list(lane.models),
                    "loaded": [
                        {"model": m, "state": s.name.lower()} for m, s in lane.loaded.items()
                    ],
                    "running": len(lane.running),
                    "waiting": lane.waiting,
                }
                for lane in dispatcher.lanes()
            ],
            "settings": dispatcher.settings.as_dict(),
        }
    )


async def health(request: HttpRequest) -> HttpResponse:
    return HttpResponse("OK", content_type="text/plain")
