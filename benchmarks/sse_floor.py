"""What one Server-Sent Events chunk costs the HTTP stack alone: a uvicorn server (httptools,
uvloop, as `pagellm serve` runs it) whose 128 streams are woken together every few milliseconds
(as an engine step wakes them) and each write one fixed ~230-byte chunk; no engine, no output
processing. The server's user + system CPU time per chunk is the floor of the API server's cost
per streamed token at one chunk per token (docs/benchmarks.md, 2026-12-03). Prints one JSON object.

    python benchmarks/sse_floor.py [--app raw|fastapi] [--streams 128] [--chunks 300]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import socket
import subprocess
import sys
import time

CHUNK = (
    b'data: {"id":"cmpl-90b45aaedd304c30acfd7e12fb8629fe","object":"text_completion",'
    b'"created":1796291637,"model":"tiny","choices":[{"index":0,"text":" token",'
    b'"logprobs":null,"finish_reason":null,"stop_reason":null}],"usage":null}\n\n'
)


def serve(app_kind: str, port: int, chunks: int, tick_s: float) -> None:
    import uvicorn
    from fastapi import FastAPI
    from fastapi.responses import StreamingResponse

    waiters: list[asyncio.Future[None]] = []

    async def ticker() -> None:
        while True:
            await asyncio.sleep(tick_s)
            woken = waiters[:]
            waiters.clear()
            for future in woken:
                future.set_result(None)

    async def events():
        loop = asyncio.get_running_loop()
        for _ in range(chunks):
            future = loop.create_future()
            waiters.append(future)
            await future
            yield CHUNK
        yield b"data: [DONE]\n\n"

    async def raw(scope, receive, send) -> None:  # ASGI, no framework
        if scope["type"] == "lifespan":
            await receive()
            asyncio.get_running_loop().create_task(ticker())
            await send({"type": "lifespan.startup.complete"})
            await receive()
            return
        await receive()
        headers = [(b"content-type", b"text/event-stream")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        async for chunk in events():
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    app = FastAPI(on_startup=[lambda: asyncio.get_running_loop().create_task(ticker())])
    app.post("/s")(lambda: StreamingResponse(events(), media_type="text/event-stream"))
    target = raw if app_kind == "raw" else app
    config = uvicorn.Config(
        target, port=port, log_level="warning", http="httptools", loop="uvloop", access_log=False
    )
    uvicorn.Server(config).run()


async def read_all(port: int, streams: int) -> int:
    import aiohttp

    async def one(session: aiohttp.ClientSession) -> int:
        async with session.post(f"http://127.0.0.1:{port}/s") as response:
            return sum([1 async for line in response.content if line.startswith(b"data:")])

    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, read_bufsize=1 << 20) as session:
        return sum(await asyncio.gather(*(one(session) for _ in range(streams))))


def main() -> int:
    import psutil

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--app", choices=["raw", "fastapi"], default="raw")
    parser.add_argument("--streams", type=int, default=128)
    parser.add_argument("--chunks", type=int, default=300, help="Chunks per stream.")
    parser.add_argument("--tick-ms", type=float, default=8.0)
    parser.add_argument("--serve-port", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_port is not None:
        serve(args.app, args.serve_port, args.chunks, args.tick_ms / 1e3)
        return 0
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [sys.executable, __file__, "--app", args.app, "--chunks", str(args.chunks)]
    server = subprocess.Popen([*cmd, "--tick-ms", str(args.tick_ms), "--serve-port", str(port)])
    try:
        time.sleep(3.0)
        asyncio.run(read_all(port, args.streams))  # warm-up
        process = psutil.Process(server.pid)
        before, writes = process.cpu_times(), process.io_counters().write_count
        events = asyncio.run(read_all(port, args.streams))
        after = process.cpu_times()
        writes = process.io_counters().write_count - writes
    finally:
        server.terminate()
        server.wait(30)
    cpu = after.user + after.system - before.user - before.system
    record = {
        "benchmark": "sse_floor",
        "app": args.app,
        "streams": args.streams,
        "events": events,
        "server_us_per_chunk": round(cpu / events * 1e6, 2),
        "server_system_us_per_chunk": round((after.system - before.system) / events * 1e6, 2),
        "writes_per_chunk": round(writes / events, 3),
        "machine": {"platform": platform.platform(), "cpu_count": os.cpu_count()},
    }
    print(json.dumps(record, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
