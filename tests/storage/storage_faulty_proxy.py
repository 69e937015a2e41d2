"""A loopback HTTP proxy in front of moto that answers chosen S3 requests with 5xx/throttling errors.

Faults happen on the wire, so the client's real retry machinery (botocore's retry handler, s3fs's
``_error_wrapper``) is what recovers, exactly as against a throttling S3.
"""

from __future__ import annotations

import http.client
import http.server
import threading
import urllib.parse
from collections.abc import Callable

__all__ = ["FaultyProxy"]

_BODIES = {
    503: b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>',
    500: b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>InternalError</Code><Message>We encountered an internal error. Please try again.</Message></Error>',
    # what S3 answers a retried conditional request that its own first attempt (landed, reply lost) refuses
    412: b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>PreconditionFailed</Code><Message>At least one of the pre-conditions you specified did not hold</Message><Condition>If-None-Match</Condition></Error>',
}


Rewrite = Callable[[str, dict[str, list[str]], int, bytes], bytes]


class FaultyProxy:
    """``should_fail(method, path, query) -> status or None`` decides per request; ``rewrite(method,
    query, status, body) -> body`` may change what upstream answered before it is passed on;
    ``drop_request_headers`` (lower case) are not passed upstream (``("range",)``: a server that
    ignores ranges and answers every GET with the whole object); ``fail_after(method, path, query) ->
    status or None`` forwards the request and then answers with that error instead of upstream's reply
    (a request that landed but whose reply was lost: the client retries it); ``cut_body(method, path,
    query) -> bool`` sends upstream's headers and half its body, then closes the connection."""

    def __init__(
        self,
        upstream: str,
        should_fail: Callable[[str, str, dict[str, list[str]]], int | None],
        rewrite: Rewrite | None = None,
        drop_request_headers: tuple[str, ...] = (),
        fail_after: Callable[[str, str, dict[str, list[str]]], int | None] | None = None,
        cut_body: Callable[[str, str, dict[str, list[str]]], bool] | None = None,
    ) -> None:
        up = urllib.parse.urlsplit(upstream)
        self.upstream = (up.hostname or "127.0.0.1", up.port or 80)
        self.should_fail = should_fail
        self.injected: list[tuple[str, str, int]] = []
        self.forwarded = 0
        lock = threading.Lock()
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _handle(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                parts = urllib.parse.urlsplit(self.path)
                query = urllib.parse.parse_qs(parts.query, keep_blank_values=True)
                with lock:
                    status = proxy.should_fail(self.command, parts.path, query)
                    if status:
                        proxy.injected.append((self.command, self.path, status))
                    else:
                        proxy.forwarded += 1
                if not status:
                    conn = http.client.HTTPConnection(*proxy.upstream, timeout=120)
                    headers = {
                        k: v
                        for k, v in self.headers.items()
                        if k.lower() not in ("connection", "transfer-encoding", *drop_request_headers)
                    }
                    conn.request(self.command, self.path, body=body, headers=headers)
                    resp = conn.getresponse()
                    data = resp.read()
                    conn.close()
                    with lock:
                        status = fail_after(self.command, parts.path, query) if fail_after is not None else None
                        if status:
                            proxy.injected.append((self.command, self.path, status))
                if status:
                    payload = _BODIES.get(status, _BODIES[500])
                    self.send_response(status)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(payload)))
                    self.send_header("Connection", "close")
                    self.end_headers()
                    self.wfile.write(payload)
                    self.close_connection = True
                    return
                if rewrite is not None:
                    data = rewrite(self.command, query, resp.status, data)
                self.send_response(resp.status, resp.reason)
                for k, v in resp.getheaders():
                    if k.lower() not in ("connection", "transfer-encoding", "content-length", "server", "date"):
                        self.send_header(k, v)
                # a HEAD has no body: its length is upstream's (a size probe reads it)
                length = resp.getheader("Content-Length") if self.command == "HEAD" else None
                self.send_header("Content-Length", length or str(len(data)))
                self.send_header("Connection", "close")
                self.end_headers()
                with lock:
                    cut = cut_body is not None and cut_body(self.command, parts.path, query)
                if self.command != "HEAD":
                    self.wfile.write(data[: len(data) // 2] if cut else data)
                self.close_connection = True

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> FaultyProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
