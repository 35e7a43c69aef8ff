"""A loopback pass-through between a peer client and `ctxrelay serve` that records each chat turn.

vLLM's multi-turn client keeps only its own timings: the server's per-turn report (the response's
`ctxrelay` field: what was reused, what was prefilled, the transport) is dropped. This proxy forwards
every request and streams every response back chunk by chunk as it arrives, and keeps, per chat
request, the messages it sent and the report in its answer. With `store_false` it sets `store: false`
on each chat body: the client cannot send it, and the server has no flag that turns reuse off, so this
is how the `no_reuse` arm opts its requests out (nothing looked up, no state kept). Both arms go
through it, so both pay the same extra hop.
"""

from __future__ import annotations

import asyncio
import json
import threading

HEADERS = ("authorization", "content-type", "x-session-id", "x-conversation-id")


def report_of(body: bytes) -> dict | None:
    """The `ctxrelay` report of a chat answer: a JSON body's, or a stream's last chunk that carries one."""
    text = body.decode("utf-8", "replace")
    if text.lstrip().startswith("{"):
        try:
            return json.loads(text).get("ctxrelay")
        except json.JSONDecodeError:
            return None
    found = None
    for line in text.splitlines():
        if line.startswith("data: {") and '"ctxrelay"' in line:
            found = json.loads(line[6:]).get("ctxrelay")
    return found


class RecordingProxy:
    """Serves 127.0.0.1:`port` in a thread of its own, forwarding to `upstream` (http://127.0.0.1:PORT)."""

    def __init__(self, upstream: str, port: int, store_false: bool = False):
        self.upstream, self.port, self.store_false = upstream, port, store_false
        self.turns: list[dict] = []  # per chat request: model, messages, status, report
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._stop: asyncio.Event | None = None
        self._error: BaseException | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> RecordingProxy:
        self._thread.start()
        if not self._ready.wait(30) or self._error is not None:
            raise RuntimeError(f"the recording proxy did not start: {self._error}")
        return self

    def __exit__(self, *exc) -> None:
        if self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)

    def _run(self) -> None:
        try:
            self._loop.run_until_complete(self._serve())
        except BaseException as e:  # reported by __enter__
            self._error = e
            self._ready.set()

    async def _serve(self) -> None:
        import aiohttp
        from aiohttp import web

        self._stop = asyncio.Event()
        timeout = aiohttp.ClientTimeout(total=None, sock_read=900)
        async with aiohttp.ClientSession(timeout=timeout, auto_decompress=False) as session:
            app = web.Application(client_max_size=64 * 2**20)

            async def handle(request):
                return await self._forward(session, request)

            app.router.add_route("*", "/{tail:.*}", handle)
            runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", self.port).start()
            self._ready.set()
            await self._stop.wait()
            await runner.cleanup()

    async def _forward(self, session, request):
        from aiohttp import web

        body = await request.read()
        chat = request.method == "POST" and request.path.endswith("/chat/completions")
        sent: dict = {}
        if chat:
            sent = json.loads(body)
            if self.store_false:
                sent["store"] = False
                body = json.dumps(sent).encode()
        headers = {k: v for k, v in request.headers.items() if k.lower() in HEADERS}
        async with session.request(request.method, self.upstream + request.path_qs, data=body, headers=headers) as up:
            out = web.StreamResponse(status=up.status)
            out.content_type = up.content_type
            await out.prepare(request)
            kept = bytearray()
            async for chunk in up.content.iter_any():  # as it arrives: the client times the first chunk
                await out.write(chunk)
                if chat:
                    kept += chunk
            await out.write_eof()
        if chat:
            self.turns.append({"model": sent.get("model"), "messages": sent.get("messages", []),
                               "status": up.status, "report": report_of(bytes(kept))})  # fmt: skip
        return out
