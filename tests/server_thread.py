"""The bundled server's application served in this process, for the tests that talk to it over HTTP.

``ServerThread`` serves an aiohttp application (``ars_opd.serving.server.app.create_app``) on an ephemeral
127.0.0.1 port from an event loop in a background thread, so a test reaches the real server over real HTTP
without a subprocess and can still read the engine (``stats``, its ``requests``) directly.
"""

from __future__ import annotations

import asyncio
import threading

from aiohttp import web

from ars_opd.serving.server import app as server_app
from ars_opd.serving.server import engine, handlers


class ServerThread:
    """The app on an ephemeral 127.0.0.1 port, served by an event loop in a background thread."""

    def __init__(self, app: web.Application):
        self.app, self.loop = app, asyncio.new_event_loop()
        self.runner = server_app.app_runner(app)  # as the server process runs it: handlers cancelled when clients go
        started = threading.Event()

        def serve():
            asyncio.set_event_loop(self.loop)
            self.loop.run_until_complete(self.runner.setup())
            self.loop.run_until_complete(web.TCPSite(self.runner, "127.0.0.1", 0).start())
            self.port = self.runner.addresses[0][1]
            started.set()
            self.loop.run_forever()

        self.thread = threading.Thread(target=serve, daemon=True)
        self.thread.start()
        assert started.wait(30), "server thread did not start"
        self.url = f"http://127.0.0.1:{self.port}"

    @property
    def stats(self) -> engine.ServerStats:
        return self.app[handlers.ENGINE_KEY].stats

    def close(self):
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)
        self.loop.close()
