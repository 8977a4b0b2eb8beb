"""Serve a trained model over OpenAI's API, with a chat page, batching many requests together.

Usage:
    python serve.py                                # the newest run, at http://127.0.0.1:8000
    python serve.py --run runs/chat_sft --port 8080 --api-key secret
    python serve.py --init-from path/to/hf_folder --parallel 32
    # then: the chat page at http://127.0.0.1:8000/, or the openai client:
    #   OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="secret")

The main endpoints (serving/app.py lists them all) are POST /v1/chat/completions, POST
/v1/completions, GET /v1/models, GET /health and GET /. Up to --parallel sequences decode
together (serving/engine.py), up to --queue more requests wait, and a request beyond those
gets a 429. On SIGTERM or Ctrl-C the server stops accepting requests, gives the running ones
a few seconds to finish, cancels the rest, and exits 0.
"""

from __future__ import annotations

import errno
import gc
import signal
import socket
import sys
import threading
from pathlib import Path
from types import FrameType
from typing import Annotated

import typer
import uvicorn

from cli.options import (
    CheckpointOption,
    DebugOption,
    DecodeOption,
    DeviceOption,
    DtypeOption,
    InitFromOption,
    RunOption,
    TemperatureOption,
    TopKOption,
    TopPOption,
)
from generate import check_decode, check_sampling
from machine.device import resolve_device
from machine.errors import UserError, reported, run_command
from serving.app import Service, create_app
from serving.engine import Engine
from weights.loading import load_model

GRACE_SECONDS = 5  # how long running answers may take to finish after SIGTERM


def listen(host: str, port: int) -> socket.socket:
    """Bind the server's socket now, so that a port already in use is reported before the
    model loads."""
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        # Name IPPROTO_TCP rather than leave it 0, because asyncio turns Nagle's algorithm
        # off (TCP_NODELAY) only on sockets that say they are TCP. With Nagle's algorithm on,
        # a reply's body waits for the client's delayed ACK of the headers on every
        # kept-alive connection.
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            raise UserError(f"port {port} on {host} is in use (another server?); stop it or "
                             f"choose another --port") from None
        if e.errno == errno.EACCES:
            raise UserError(f"port {port} needs privileges this user lacks; choose a port "
                             f"above 1023") from None
        raise UserError(f"cannot listen on {host}:{port} ({e.strerror or e}); check "
                         f"--host") from None
    sock.listen(128)
    return sock


def model_name(source: str, init_from: str | None) -> str:
    """The name /v1/models gives the model: the run folder's name (runs/NAME/best.pt), the
    checkpoint's own name (NAME.pt), or the Hugging Face folder's name."""
    path = Path(source)
    if init_from:
        return path.resolve().name
    return path.parent.resolve().name if path.name in ("best.pt", "last.pt") else path.stem


def run_server(service: Service, sock: socket.socket) -> None:
    """Serve until SIGTERM or Ctrl-C. uvicorn runs in a thread of its own and the engine in
    the main thread (serving/engine.py says why). A signal makes uvicorn stop accepting
    connections and drains the engine: running requests get GRACE_SECONDS to finish and are
    then cancelled, each stream ending with an error event, before uvicorn would cut the
    connections."""
    config = uvicorn.Config(create_app(service), log_level="warning",
                            timeout_graceful_shutdown=GRACE_SECONDS + 2)
    server = uvicorn.Server(config)

    def stop(signum: int, frame: FrameType | None) -> None:
        server.should_exit = True
        service.engine.drain(GRACE_SECONDS)

    def http() -> None:
        try:
            server.run(sockets=[sock])
        finally:  # whatever ends the HTTP side ends the engine too
            service.engine.drain(GRACE_SECONDS)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, stop)
    # The objects made at startup (torch's and the model's) live as long as the process.
    # Freezing them keeps them out of the collector's full passes, which stop every thread,
    # the event loop's included, for as long as they take to walk what the process holds.
    gc.freeze()
    thread = threading.Thread(target=http, name="http")
    thread.start()
    service.engine.run()
    server.should_exit = True
    thread.join()
    print("stopped", file=sys.stderr)


# The options, one per line. Each option's help text is its documentation
# (python serve.py --help). Options that sample.py and evaluate.py also take are declared
# in cli/options.py.
HostOption = Annotated[str, typer.Option(help="Address to listen on; 0.0.0.0 for every "
                                           "interface.")]
PortOption = Annotated[int, typer.Option(min=0, max=65535, help="Port to listen on.")]
ApiKeyOption = Annotated[str | None, typer.Option(
        help="Require 'Authorization: Bearer KEY' (the openai client's api_key) on every "
             "route but the chat page, /health and /metrics.")]
ParallelOption = Annotated[int, typer.Option(
        min=1, help="Sequences decoded together (slots; each holds a KV cache row).")]
QueueOption = Annotated[int, typer.Option(
        min=0, help="Requests that may wait for a slot; past that, 429.")]
MaxTokensOption = Annotated[int, typer.Option(
        min=1, help="New tokens when a request names none (capped by the context).")]


def main(
    run: RunOption = None,
    checkpoint: CheckpointOption = None,
    init_from: InitFromOption = None,
    host: HostOption = "127.0.0.1",
    port: PortOption = 8000,
    api_key: ApiKeyOption = None,
    parallel: ParallelOption = 16,
    queue: QueueOption = 64,
    max_tokens: MaxTokensOption = 500,
    temperature: TemperatureOption = 0.8,
    top_k: TopKOption = None,
    top_p: TopPOption = None,
    device: DeviceOption = "cpu",
    dtype: DtypeOption = "float32",
    decode: DecodeOption = "auto",
    debug: DebugOption = False,
) -> None:
    """Serve a model over OpenAI's API (chat and text completions) with a chat page at /."""
    with reported(debug=debug):
        check_sampling(temperature, top_k, top_p)
        check_decode(decode, "--decode")
        device = str(resolve_device(device))
        sock = listen(host, port)
        loaded: list[str] = []
        model, tokenizer, source = load_model(run, checkpoint, init_from, device, dtype,
                                              say=loaded.append)
        engine = Engine(model, tokenizer, parallel, queue, decode)
    for line in loaded:
        print(line, file=sys.stderr)
    service = Service(engine, tokenizer, model_name(source, init_from), model.config.block_size,
                      max_tokens, temperature, top_k, top_p, api_key)
    shown = f"[{host}]" if ":" in host else host
    slots = f"{parallel} slot{'s' * (parallel > 1)} of {model.config.block_size} tokens"
    print(f"serving {service.name} ({source}, {slots}) at http://{shown}:{sock.getsockname()[1]}/ : "
          f"the chat page there, OpenAI's API under /v1", file=sys.stderr, flush=True)
    run_server(service, sock)


if __name__ == "__main__":
    run_command(main)
