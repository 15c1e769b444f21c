"""Run an app under uvicorn on a background thread: for tests, benchmarks and notebooks."""

from __future__ import annotations

import contextlib
import threading
import time


@contextlib.contextmanager
def serving(app, *, host: str = "127.0.0.1", port: int = 0, timeout: float = 30.0, log_level: str = "warning"):
    """``with serving(app) as url:`` the app answers at ``url`` (``http://host:port``; port 0 picks a free one).

        >>> with serving(build_app(inf)) as url:
        ...     openai.OpenAI(base_url=url + "/v1", api_key="-").models.list()
    """
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="off"))
    thread = threading.Thread(target=server.run, name="slotinfer-uvicorn", daemon=True)
    thread.start()
    end = time.monotonic() + timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > end:
            raise RuntimeError(f"the server did not start on {host}:{port}")
        time.sleep(0.01)
    bound = server.servers[0].sockets[0].getsockname()
    try:
        yield f"http://{host}:{bound[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout)
