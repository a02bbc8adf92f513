"""Issue 29: the explorer answers every malformed POST with an HTTP error (it used to send no reply at all)."""

from __future__ import annotations

import http.client
import json
import threading
from types import SimpleNamespace

import pytest

from qkv.cli.explore import ExplorerApp, make_server


@pytest.fixture(scope="module")
def server():
    app = ExplorerApp(SimpleNamespace(max_seq_length=256), max_chars=400, max_tokens=24)  # no model is reached
    srv = make_server(app, "127.0.0.1", 0)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield srv
    srv.shutdown()
    srv.server_close()


def _post(srv, body: bytes, length: str | None = None):
    conn = http.client.HTTPConnection(*srv.server_address[:2], timeout=10)
    conn.putrequest("POST", "/api/attention")
    conn.putheader("Content-Type", "application/json")
    conn.putheader("Content-Length", str(len(body)) if length is None else length)
    conn.endheaders()
    conn.send(body)
    r = conn.getresponse()
    status, payload = r.status, json.loads(r.read() or b"{}")
    conn.close()
    return status, payload


@pytest.mark.parametrize("case", ["length-abc", "length-negative", "deep-json", "lone-surrogate", "not-an-object"])
def test_explorer_replies_to_malformed_posts(server, case):
    body, length = {
        "length-abc": (b'{"text": "hi"}', "abc"),
        "length-negative": (b'{"text": "hi"}', "-5"),
        "deep-json": (b"[" * 2000 + b"]" * 2000, None),  # under the size limit, past the parser's depth
        "lone-surrogate": (b'{"text": "a \\ud800 b"}', None),
        "not-an-object": (b"[1, 2]", None),
    }[case]
    status, payload = _post(server, body, length)
    assert status == 400, (status, payload)
    assert payload.get("error"), payload
