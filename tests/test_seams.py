"""Where llamaswap leans on a framework's private internals, each for a measured reason:
one test per seam that fails if the framework changes under it.

| seam | why (see BENCHMARKS.md) | where |
| --- | --- | --- |
| Django ``HttpResponse._resource_closers`` | close a response without the ``request_finished`` signal (a thread hop per request under ASGI) | ``proxy.handler.close_response`` |
| Django ``HttpRequest._body`` | the body as one bytes object, no copy, no 2.5 MB ceiling | ``ProxyHandler.handle`` |
| Twisted ``Request._parsePOSTFormSubmission`` | a POST body is not parsed as a form by Twisted too | ``http_server.skip_twisted_form_parsing`` |
| httpcore's per-read timeout from ``request.extensions["timeout"]`` | the idle limit between a stream's chunks without a timer per chunk | ``proxy.relay._send`` |
| ``gc.freeze()`` at import | full collections walked the Django heap: 55-75 ms pauses | ``llamaswap_site.asgi`` |
"""

from __future__ import annotations

import gc
import inspect

from django.http import HttpRequest, HttpResponse


def test_django_responses_still_close_through_resource_closers():
    from proxy.handler import close_response as _close

    assert "_resource_closers" in inspect.getsource(HttpResponse.close)
    ran = []
    response = HttpResponse(b"x")
    response._resource_closers.append(lambda: ran.append(True))
    _close(response)
    assert ran == [True] and response.closed


def test_django_requests_still_read_the_body_from_underscore_body():
    request = HttpRequest()
    body = b"x" * (3 * 1024 * 1024)  # over DATA_UPLOAD_MAX_MEMORY_SIZE: no check, no copy
    request._body = body
    assert request.body is body


def test_twisted_still_reads_parse_post_form_submission():
    import daphne.server  # noqa: F401  (the asyncio reactor first)
    from daphne.http_protocol import WebRequest
    from twisted.web.http import Request

    from llamaswap_site.http_server import skip_twisted_form_parsing

    assert "self._parsePOSTFormSubmission" in inspect.getsource(Request.requestReceived)
    assert skip_twisted_form_parsing()
    assert WebRequest.__dict__["_parsePOSTFormSubmission"].__get__(object()) is False


def test_httpcore_still_reads_the_read_timeout_when_the_body_starts():
    from httpcore._async.http11 import AsyncHTTP11Connection

    source = inspect.getsource(AsyncHTTP11Connection._receive_response_body)
    assert 'request.extensions.get("timeout"' in source and 'timeouts.get("read"' in source


def test_the_django_heap_is_frozen_out_of_the_cyclic_gc():
    import llamaswap_site.asgi  # noqa: F401

    assert gc.get_freeze_count() > 0
