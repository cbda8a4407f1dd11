"""``/comfyui`` and ``/comfyui/{path}``: llama-swap's passthrough to its fixed ComfyUI model
(``comfyui_auto``, llama-swap's #1001), over HTTP. The rules (which model, which path may
start it) are :func:`proxy.passthrough.comfyui`'s, shared with the websocket relay
(``proxy.wsproxy``); the request is relayed as ``/upstream/comfyui_auto/{path}`` would be
(a turn, the model's answer as it comes, a record), with the path as the client encoded it.
"""

from __future__ import annotations

from django.http import HttpRequest, HttpResponse, HttpResponseBase
from django.views.decorators.csrf import csrf_exempt

from proxy import passthrough
from proxy.relay import relay
from proxy.views import new_request_id
from web.errors import error_response
from web.runtime import runtime_of


@csrf_exempt
async def comfyui_redirect(request: HttpRequest) -> HttpResponse:
    """ANY /comfyui: to ``/comfyui/`` (the query kept), so the page's relative links
    resolve (:func:`proxy.passthrough.slash_redirect`)."""
    return passthrough.slash_redirect(request, passthrough.COMFYUI)


@csrf_exempt
async def comfyui_passthrough(request: HttpRequest, path: str = "") -> HttpResponseBase:
    """ANY /comfyui/{path}: relayed to ``comfyui_auto``'s ``/{path}``; only the root may
    start the model (:func:`proxy.passthrough.comfyui`)."""
    request_id = new_request_id()
    decoded = "/" + path
    found = passthrough.comfyui(runtime_of(request), decoded)
    if isinstance(found, passthrough.Refusal):
        return error_response(found.status, found.message, code=found.code, request_id=request_id)
    scope = getattr(request, "scope", None)
    raw = passthrough.raw_after(scope, passthrough.COMFYUI, decoded)
    return await relay(request, found, request_id, raw, request.body)
