"""Serving under load: throughput and latency of serve.py at 1, 4, 16 and 64 concurrent
clients, and of llama.cpp's llama-server on the same model, prompts and lengths.

Usage:
    python -m benchmarks.serve                              # serve.py alone, fp32 and int8
    bash benchmarks/build_llama_server.sh                   # once; a long build (docs/serving.md)
    python -m benchmarks.serve --llama ~/.cache/gptlab/llama.cpp --json serve.json
    python -m benchmarks.serve --clients 1,16 --max-tokens 32 --servers ours-fp32
    python -m benchmarks.serve --turns 8 --clients 1,4 --max-tokens 32   # conversations
    python -m benchmarks.serve --servers ours-fp32 --clients 1,4 --neighbours 1   # a busy machine

The model is GPT-2 small (124M) with random weights and GPT-2's tokenizer, written as a
checkpoint for serve.py and exported (export.py) then converted (llama.cpp's
convert_hf_to_gguf.py) to GGUF for llama-server: f32 beside our float32, Q8_0 beside our
int8. Each server runs on its own, with 16 slots and every core. At each level, that many
clients each send one request at once (streamed, greedy, max_tokens new tokens, prompts of
about 30 tokens, each its own), and the figures are: throughput (every answer's tokens over
the wall time), time to first token and time per later token (p50 and p95 over requests).
The 1-client row is the same requests sent one by one; every other row's ratio is against it.
--neighbours N runs N CPU-bound processes beside each server while it is measured.
"""

from __future__ import annotations

import http.client
import json as json_module
import shlex
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated

import torch
import typer

from benchmarks import check_paths, neighbours
from machine.device import cpu_name
from machine.errors import UserError, reported, run_command
from measure.decoding import preset_config
from model import GPT
from weights.checkpoint import FORMAT, VERSION, save_checkpoint

REPO = Path(__file__).resolve().parent.parent
SERVERS = ("ours-fp32", "ours-int8", "llama-f32", "llama-q8_0")
WORDS = "the king of Denmark spoke to his court of love and war in the night".split()


def write_model(folder: Path) -> Path:
    """GPT-2 small with random weights as this project's checkpoint, GPT-2's tokenizer."""
    torch.manual_seed(0)
    model = GPT(preset_config("gpt2"))
    path = folder / "gpt2" / "best.pt"
    path.parent.mkdir()
    save_checkpoint({"format": FORMAT, "version": VERSION, "model_args": vars(model.config),
                     "model": model.state_dict(), "iter_num": 0, "config": {},
                     "tokenizer": {"kind": "gpt2", "vocab_size": 50257}}, path)
    return path


def gguf(checkpoint: Path, llama: Path, outtype: str) -> Path:
    """The checkpoint as GGUF: exported by export.py, converted by llama.cpp's script."""
    hf = checkpoint.parent.parent / "hf"
    if not hf.exists():
        run([sys.executable, str(REPO / "export.py"), str(checkpoint), str(hf)])
    out = hf.parent / f"gpt2-{outtype}.gguf"
    run([sys.executable, str(llama / "convert_hf_to_gguf.py"), str(hf), "--outfile", str(out),
         "--outtype", outtype])
    return out


def run(command: list[str]) -> None:
    result = subprocess.run(command, capture_output=True, text=True, cwd=REPO)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command[:3])} failed: {result.stderr.strip()[-2000:]}")


@contextmanager
def started(command: list[str], port: int) -> Iterator[str]:
    """A server process, once its /health answers 200; its base URL. Its log goes to a
    temporary file, whose end a failure shows."""
    with tempfile.TemporaryFile() as log:
        process = subprocess.Popen(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)

        def failed(why: str) -> RuntimeError:
            log.seek(0)
            return RuntimeError(f"{command[0]} {why}: {log.read().decode(errors='replace')[-2000:]}")

        try:
            for _ in range(600):
                if process.poll() is not None:
                    raise failed(f"ended with {process.returncode} before it served")
                try:
                    if get("127.0.0.1", port, "/health") == 200:
                        break
                except OSError:
                    pass
                time.sleep(0.5)
            else:
                raise failed("did not answer /health within 5 minutes")
            yield f"127.0.0.1:{port}"
        finally:
            process.terminate()
            process.wait()


def get(host: str, port: int, path: str) -> int:
    connection = http.client.HTTPConnection(host, port, timeout=5)
    try:
        connection.request("GET", path)
        return connection.getresponse().status
    finally:
        connection.close()


def timed_request(address: str, prompt: str, max_tokens: int,
                  cache_prompt: bool = True) -> dict[str, float]:
    """One streamed completion: when each piece of text came, and the tokens it counted.
    cache_prompt false (a field of llama.cpp's and serve.py's) prefills the whole prompt."""
    host, port = address.split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=600)
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True,
            "cache_prompt": cache_prompt}
    start = time.perf_counter()
    connection.request("POST", "/v1/completions", json_module.dumps(body),
                       {"Content-Type": "application/json"})
    response = connection.getresponse()
    if response.status != 200:
        raise RuntimeError(f"the server answered {response.status}: {response.read()[:300]!r}")
    arrivals, tokens, text = [], 0, []
    for line in response:
        if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
            continue
        event = json_module.loads(line[6:])
        if event.get("usage"):
            tokens = event["usage"]["completion_tokens"]
        pieces = [c.get("text") for c in event.get("choices", []) if c.get("text")]
        if pieces:
            arrivals.append(time.perf_counter())
            text += pieces
    connection.close()
    tokens = tokens or len(arrivals)
    return {"ttft": arrivals[0] - start, "end": arrivals[-1], "start": start, "tokens": tokens,
            "per_token": (arrivals[-1] - arrivals[0]) / max(tokens - 1, 1), "text": "".join(text)}


def level(address: str, clients: int, max_tokens: int) -> dict[str, float]:
    """`clients` clients at once, each sending its requests one after the other (4 for a
    lone client, one each otherwise), each request its own prompt; the level's figures."""
    per_client = max(1, 4 // clients)
    prompts = [f"Request {i}: " + " ".join(WORDS[(i + j) % len(WORDS)] for j in range(24))
               for i in range(clients * per_client)]
    results: list[dict[str, float]] = []

    def client(first: int) -> None:
        for prompt in prompts[first:first + per_client]:
            results.append(timed_request(address, prompt, max_tokens))

    threads = [threading.Thread(target=client, args=(c * per_client,)) for c in range(clients)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if len(results) != len(prompts):
        raise RuntimeError(f"{len(prompts) - len(results)} of {len(prompts)} requests failed")
    wall = max(r["end"] for r in results) - start
    ttft = sorted(r["ttft"] for r in results)
    per_token = sorted(r["per_token"] for r in results)
    tokens = sum(r["tokens"] for r in results)
    return {"clients": clients, "requests": len(prompts), "tokens": tokens,
            "tokens_per_s": tokens / wall,
            "ttft_p50_ms": 1000 * percentile(ttft, 50), "ttft_p95_ms": 1000 * percentile(ttft, 95),
            "per_token_p50_ms": 1000 * percentile(per_token, 50),
            "per_token_p95_ms": 1000 * percentile(per_token, 95)}


def conversations(address: str, clients: int, turns: int, max_tokens: int,
                  cache_prompt: bool) -> list[dict]:
    """`clients` clients at once, each holding a conversation of `turns` turns: every turn
    sends the whole history (each earlier line and its answer) and a new line, as an OpenAI
    client sends a chat. Each turn's time to the first token, p50 and p95 over the clients,
    and the history's length in characters."""
    ttft: list[list[float]] = [[] for _ in range(turns)]
    length = [0] * turns

    def client(c: int) -> None:
        history = ""
        for t in range(turns):
            history += f"\nClient {c}, turn {t}: " + " ".join(
                WORDS[(c + t + j) % len(WORDS)] for j in range(20))
            r = timed_request(address, history, max_tokens, cache_prompt)
            ttft[t].append(r["ttft"])
            length[t] = max(length[t], len(history))
            history += r["text"]

    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if any(len(times) != clients for times in ttft):
        raise RuntimeError("a turn's request failed")
    return [{"turn": t + 1, "clients": clients, "prompt_chars": length[t],
             "ttft_p50_ms": 1000 * percentile(sorted(ttft[t]), 50),
             "ttft_p95_ms": 1000 * percentile(sorted(ttft[t]), 95)} for t in range(turns)]


def percentile(sorted_values: list[float], p: int) -> float:
    return sorted_values[min(len(sorted_values) - 1, round(p / 100 * (len(sorted_values) - 1)))]


def server_command(name: str, checkpoint: Path, llama: Path | None, port: int,
                   slots: int, context: int, device: str, decode: str,
                   llama_args: str = "") -> list[str]:
    threads = str(torch.get_num_threads())
    if name.startswith("ours"):
        dtype = "int8" if name.endswith("int8") else "float32"
        return [sys.executable, "serve.py", "--checkpoint", str(checkpoint), "--port", str(port),
                "--parallel", str(slots), "--queue", "256", "--dtype", dtype,
                "--device", device, "--decode", decode]
    if llama is None:
        raise UserError(f"{name} needs --llama, the folder benchmarks/build_llama_server.sh "
                         f"built")
    model = gguf(checkpoint, llama, name.split("-")[1])
    return [str(llama / "build" / "bin" / "llama-server"), "-m", str(model), "--port", str(port),
            "--parallel", str(slots), "-c", str(slots * context), "-t", threads, "-tb", threads,
            "--no-webui", *shlex.split(llama_args)]  # as a shell splits them


def main(servers: str = "ours-fp32,ours-int8,llama-f32,llama-q8_0", clients: str = "1,4,16,64",
         max_tokens: Annotated[int, typer.Option(min=2)] = 64,
         slots: Annotated[int, typer.Option(min=1)] = 16, llama: Path | None = None,
         port: int = 8431, json: Path | None = None,
         device: Annotated[str, typer.Option(help="serve.py's --device.")] = "cpu",
         decode: Annotated[str, typer.Option(help="serve.py's --decode.")] = "auto",
         turns: Annotated[int, typer.Option(
             min=0, help="Instead of the levels: each client holds a conversation of this "
                         "many turns, sending its whole history at every turn; the time to "
                         "the first token by turn.")] = 0,
         llama_args: Annotated[str, typer.Option(
             help="More arguments for llama-server, as one string (--no-repack where its "
                  "weight repacking stops with an illegal instruction).")] = "",
         cache_prompt: Annotated[bool, typer.Option(
             help="With --turns: --no-cache-prompt asks each server to prefill the whole "
                  "history every turn, reusing nothing.")] = True,
         busy: Annotated[int, typer.Option(
             "--neighbours", min=0, max=64,
             help="CPU-bound processes beside each server while it is measured.")] = 0) -> None:
    """Print each server's figures at each level of concurrency, or by turn of a
    conversation (--turns)."""
    with reported():
        names = servers.split(",")
        if not set(names) <= set(SERVERS):
            raise UserError(f"--servers takes some of {', '.join(SERVERS)}, got {servers!r}")
        levels = [int(c) for c in clients.split(",")]
        check_paths(json_path=json)
        if llama is not None and not (llama / "build" / "bin" / "llama-server").is_file():
            raise UserError(f"{llama} has no build/bin/llama-server; run "
                             f"benchmarks/build_llama_server.sh {llama} first")
        where = (torch.cuda.get_device_name() if device.startswith("cuda")
                 else f"{torch.get_num_threads()} threads, {cpu_name()}")
        print(f"# GPT-2 small (random weights), {max_tokens} new tokens, {slots} slots, "
              f"{where}" + (f", beside {busy} CPU-bound processes" if busy else ""))
        figures = {}
        with tempfile.TemporaryDirectory() as tmp:
            checkpoint = write_model(Path(tmp))
            for name in names:
                context = 1024 if turns else 128 + max_tokens  # a slot's, for llama-server
                command = server_command(name, checkpoint, llama, port, slots, context,
                                         device, decode, llama_args)
                with started(command, port) as address, neighbours(busy):
                    timed_request(address, "warm", 4)  # the first request builds the C step
                    if turns:
                        figures[name] = [row for c in levels
                                         for row in conversations(address, c, turns, max_tokens,
                                                                  cache_prompt)]
                    else:
                        figures[name] = [level(address, c, max_tokens) for c in levels]
                (report_turns if turns else report)(name, figures[name])
        if json is not None:
            json.write_text(json_module.dumps({"cpu": cpu_name(), "max_tokens": max_tokens,
                                               "slots": slots, "servers": figures}, indent=1))


def report_turns(name: str, rows: list[dict[str, float]]) -> None:
    print(f"\n{name}\n clients  turn  prompt chars  TTFT p50/p95 ms")
    for r in rows:
        print(f" {r['clients']:7d} {r['turn']:5d} {r['prompt_chars']:13,d}  {r['ttft_p50_ms']:7.0f} "
              f"{r['ttft_p95_ms']:7.0f}")
    sys.stdout.flush()


def report(name: str, rows: list[dict[str, float]]) -> None:
    one = rows[0]["tokens_per_s"] if rows[0]["clients"] == 1 else None
    print(f"\n{name}\n clients  tok/s  x1-by-1  TTFT p50/p95 ms  per-token p50/p95 ms")
    for r in rows:
        ratio = f"{r['tokens_per_s'] / one:7.1f}x" if one else "      -"
        print(f" {r['clients']:7d} {r['tokens_per_s']:6.1f} {ratio}  {r['ttft_p50_ms']:7.0f} "
              f"{r['ttft_p95_ms']:7.0f}  {r['per_token_p50_ms']:9.1f} {r['per_token_p95_ms']:7.1f}")
    sys.stdout.flush()


if __name__ == "__main__":
    run_command(main)
