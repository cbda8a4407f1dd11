"""A model server that speaks Anthropic's ``/v1/messages`` as llama-server does (whole and
streamed, usage in ``message_start`` and ``message_delta``) and OpenAI's ``/v1/responses``
(usage nested in ``response.completed``): the shapes proxy/usage.py reads, end to end.

``python -m tests.anthropic_model PORT``; ``GET /health`` answers 200. Standard library.
"""

from __future__ import annotations

import json
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

INPUT_TOKENS, OUTPUT_TOKENS, CACHED = 21, 5, 8


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:
        self._send(200, "application/json", b'{"status":"ok"}')

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
        if self.path == "/v1/messages":
            events = self._messages()
        elif self.path == "/v1/responses":
            events = self._responses()
        else:
            self._send(404, "application/json", b'{"error":"not found"}')
            return
        if not body.get("stream"):
            self._send(200, "application/json", json.dumps(events[-1][1]).encode())
            return
        stream = b"".join(
            f"event: {name}\ndata: {json.dumps(data)}\n\n".encode() for name, data in events[:-1]
        )
        self._send(200, "text/event-stream", stream)

    def _messages(self) -> list:
        usage = {"input_tokens": INPUT_TOKENS, "cache_read_input_tokens": CACHED}
        start = {"type": "message_start", "message": {"usage": {**usage, "output_tokens": 0}}}
        delta = {"type": "content_block_delta", "delta": {"type": "text_delta", "text": "hi"}}
        end = {"type": "message_delta", "usage": {"output_tokens": OUTPUT_TOKENS}}
        whole = {
            "type": "message",
            "role": "assistant",
            "content": [{"type": "text", "text": "hi"}],
            "usage": {**usage, "output_tokens": OUTPUT_TOKENS},
        }
        return [
            ("message_start", start),
            *[("content_block_delta", delta)] * 40,
            ("message_delta", end),
            ("message_stop", {"type": "message_stop"}),
            ("", whole),
        ]

    def _responses(self) -> list:
        usage = {
            "input_tokens": INPUT_TOKENS,
            "output_tokens": OUTPUT_TOKENS,
            "input_tokens_details": {"cached_tokens": CACHED},
        }
        whole = {"object": "response", "status": "completed", "usage": usage}
        return [
            ("response.created", {"type": "response.created", "response": {"usage": None}}),
            ("response.completed", {"type": "response.completed", "response": whole}),
            ("", whole),
        ]

    def _send(self, status: int, content_type: str, data: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


if __name__ == "__main__":
    ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
