"""The server over raw HTTP: SSE framing, disconnects, back-pressure (429), body limits (413),
engine failures, many concurrent streams, and shutdown on SIGINT/SIGTERM."""

import asyncio
import contextlib
import gc
import json
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

import slotinfer
from slotinfer.serve import build_app
from slotinfer.serve.background import serving

LONG = {"max_tokens": 4000, "ignore_eos": True}  # runs for seconds unless cancelled (max_len=4096)


@pytest.fixture(scope="module")
def model(model_dir):
    return slotinfer.load(model_dir("qwen3"))


def _until(cond, timeout=30.0):
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.005)


def _events(lines):
    """SSE ``data:`` payloads of a response, checking the framing on the way."""
    out = []
    for block in lines.split("\n\n"):
        if not block:
            continue
        assert block.startswith("data: ") and "\n" not in block, block
        out.append(block[len("data: "):])
    return out


def test_sse_framing(model):
    with slotinfer.Inferencer(model, slots=2, max_len=128) as inf, serving(build_app(inf)) as url:
        r = httpx.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                       "max_tokens": 8, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}})
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        assert r.text.endswith("\n\ndata: [DONE]\n\n")
        events = _events(r.text)
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert {c["object"] for c in chunks} == {"chat.completion.chunk"} and len({c["id"] for c in chunks}) == 1
        assert chunks[-1]["usage"]["completion_tokens"] >= 1 and chunks[-1]["choices"] == []


def test_a_closed_stream_frees_its_slot(model):
    with slotinfer.Inferencer(model, slots=2, max_len=4096) as inf, serving(build_app(inf)) as url:
        with httpx.Client(timeout=60) as c:
            with c.stream("POST", url + "/v1/completions", json={"prompt": "go", "stream": True, **LONG}) as r:
                lines = r.iter_lines()
                assert next(lines).startswith("data: ")
                assert inf.stats()["active_slots"] == 1
                steps = inf.stats()["steps"]
        _until(lambda: inf.stats()["active_slots"] == 0)
        assert inf.stats()["steps"] - steps < 3000  # cancelled, not run to its 4000 tokens


def test_an_aborted_request_frees_its_slot_and_logs_nothing(model, caplog):
    """A whole (not streamed) request whose client goes away: its rows are cancelled, and nothing is
    logged (it was "_GatheringFuture exception was never retrieved" with a CancelledError traceback)."""
    with slotinfer.Inferencer(model, slots=2, max_len=4096) as inf, serving(build_app(inf)) as url:
        port = int(url.rsplit(":", 1)[1])
        body = json.dumps({"prompt": "go", "n": 2, **LONG}).encode()
        s = socket.create_connection(("127.0.0.1", port))
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n" % len(body) + body)
        _until(lambda: inf.stats()["active_slots"] == 2)
        s.close()
        _until(lambda: inf.stats()["active_slots"] == 0)
        assert inf.stats()["decode_tokens"] < 3000
        _until(lambda: 'outcome="cancelled"} 1.0' in httpx.get(url + "/metrics").text)
        time.sleep(0.2)
        gc.collect()  # an unretrieved future logs when it is collected
    assert not [r for r in caplog.records if r.name == "asyncio"], caplog.text


def test_full_queue_is_429_at_once_and_others_go_on(model):
    with slotinfer.Inferencer(model, slots=1, max_len=4096, max_queue=1) as inf, serving(build_app(inf)) as url:
        with httpx.Client(timeout=60) as a, httpx.Client(timeout=60) as b:
            with a.stream("POST", url + "/v1/completions", json={"prompt": "first", "stream": True, **LONG}) as ra:
                first = ra.iter_lines()  # one iterator: dropping one closes the connection
                next(first)  # holds the only slot
                with b.stream("POST", url + "/v1/completions", json={"prompt": "second", "stream": True, **LONG}):
                    _until(lambda: inf.stats()["waiting"] == 1)
                    t0 = time.monotonic()
                    r = httpx.post(url + "/v1/completions", json={"prompt": "third", "max_tokens": 2})
                    assert time.monotonic() - t0 < 5
                    assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
                    err = r.json()["error"]
                    assert err["code"] == "rate_limit_exceeded" and "block=True" not in err["message"]
                    assert "Retry-After" in err["message"] and "--max-queue" in err["message"], err
                    assert next(x for x in first if x).startswith("data: ")  # the running stream goes on
        _until(lambda: inf.stats()["active_slots"] == 0 and inf.stats()["waiting"] == 0)
        assert httpx.post(url + "/v1/completions", json={"prompt": "later", "max_tokens": 2}).status_code == 200


def test_oversized_body_is_413(model):
    with slotinfer.Inferencer(model, slots=1, max_len=64) as inf, serving(build_app(inf, max_body_bytes=2000)) as url:
        r = httpx.post(url + "/v1/completions", json={"prompt": "x" * 3000})
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
        assert httpx.post(url + "/v1/completions", json={"prompt": "x" * 20, "max_tokens": 1}).status_code == 200


def _upload(port: int, head: bytes, body) -> bytes:
    """Sends a request whole (``body``: bytes, or chunks), then reads the answer to its end, as a client
    that reads only once it has sent everything does."""
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    s.sendall(head)
    for chunk in [body] if isinstance(body, bytes) else body:
        s.sendall(chunk)
    got = b""
    while chunk := s.recv(65536):
        got += chunk
    s.close()
    return got


def test_an_over_limit_upload_reads_its_413_whatever_the_client(model):
    """Closing with unread bytes resets the connection: a client that sends a body over the limit whole
    before reading must still read a JSON 413, not ECONNRESET."""
    import urllib.error
    import urllib.request

    import openai
    body = json.dumps({"prompt": "x" * (8 << 20), "max_tokens": 1}).encode()  # 128 times the limit
    with slotinfer.Inferencer(model, slots=1, max_len=64) as inf, \
            serving(build_app(inf, max_body_bytes=64 << 10)) as url:
        port = int(url.rsplit(":", 1)[1])
        head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nConnection: close\r\n")
        got = _upload(port, head + b"Content-Length: %d\r\n\r\n" % len(body), body)
        assert got.startswith(b"HTTP/1.1 413") and b'"request_too_large"' in got, got[:200]
        chunks = (b"%x\r\n%s\r\n" % (len(c), c) for c in [body[i:i + 65536] for i in range(0, len(body), 65536)] + [b""])
        got = _upload(port, head + b"Transfer-Encoding: chunked\r\n\r\n", chunks)  # no length declared
        assert got.startswith(b"HTTP/1.1 413") and b'"request_too_large"' in got, got[:200]

        with pytest.raises(urllib.error.HTTPError) as e:  # urllib sends `Connection: close`
            urllib.request.urlopen(urllib.request.Request(url + "/v1/completions", data=body,
                                                          headers={"Content-Type": "application/json"}), timeout=30)
        assert e.value.code == 413 and json.loads(e.value.read())["error"]["code"] == "request_too_large"
        client = openai.OpenAI(base_url=url + "/v1", api_key="-", max_retries=0)
        with pytest.raises(openai.APIStatusError) as e:
            client.completions.create(model="m", prompt="x" * (8 << 20), max_tokens=1)
        assert e.value.status_code == 413 and e.value.code == "request_too_large"
        assert httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 1}).status_code == 200


def test_what_is_read_of_a_refused_body_is_bounded(model):
    """The 413 goes out at once; the server then reads at most DRAIN_BYTES more, and no longer than the
    read timeout, before it closes the connection."""
    from slotinfer.serve.http import DRAIN_BYTES
    with slotinfer.Inferencer(model, slots=1, max_len=64) as inf, \
            serving(build_app(inf, max_body_bytes=64 << 10, read_timeout=2.0)) as url:
        port = int(url.rsplit(":", 1)[1])
        head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        s = socket.create_connection(("127.0.0.1", port), timeout=30)  # a body without end, sent at full speed
        s.sendall(head + b"Content-Length: %d\r\n\r\n" % (1 << 40))
        sent, chunk = 0, b"x" * (1 << 20)
        with pytest.raises(OSError):  # reset or broken pipe: the server closed
            while sent < 4 * DRAIN_BYTES:
                sent += s.send(chunk)
        s.close()
        assert sent < DRAIN_BYTES + (32 << 20), sent  # what the socket buffers hold beyond the drain

        s = socket.create_connection(("127.0.0.1", port), timeout=30)  # a body trickled: it reads its 413 at once
        s.sendall(head + b"Content-Length: %d\r\n\r\n" % (1 << 20))
        t0 = time.monotonic()
        s.settimeout(0.1)
        got = b""
        while b"request_too_large" not in got:
            assert time.monotonic() - t0 < 5, got
            s.sendall(b"x" * 100)
            with contextlib.suppress(TimeoutError):
                got += s.recv(65536)
        assert got.startswith(b"HTTP/1.1 413") and b"connection: close" in got.lower()
        with pytest.raises(OSError):  # closed at the read timeout however slowly the body comes
            while time.monotonic() - t0 < 10:
                s.sendall(b"x" * 100)
                time.sleep(0.05)
        assert time.monotonic() - t0 < 4
        s.close()


def test_engine_failure_is_500_for_the_requests_in_flight_only(model):
    with slotinfer.Inferencer(model, slots=4, max_len=4096) as inf, serving(build_app(inf)) as url:
        real_step, broken = inf.engine.decoder.step, threading.Event()

        def step(*a, **kw):  # a device failure, injected into the engine's real step
            if broken.is_set():
                broken.clear()
                raise RuntimeError("device lost")
            return real_step(*a, **kw)

        inf.engine.decoder.step = step
        out = {}
        t = threading.Thread(target=lambda: out.update(r=httpx.post(url + "/v1/completions", timeout=60,
                                                                    json={"prompt": "a", **LONG})))
        t.start()
        with httpx.stream("POST", url + "/v1/completions", json={"prompt": "b", "stream": True, **LONG}, timeout=60) as s:
            lines = s.iter_lines()
            next(lines)
            _until(lambda: inf.stats()["active_slots"] == 2)
            broken.set()
            rest = [line for line in lines if line]
        t.join(60)
        assert out["r"].status_code == 500 and "device lost" in out["r"].json()["error"]["message"]
        assert rest[-1] == "data: [DONE]" and json.loads(rest[-2][6:])["error"]["type"] == "server_error"
        after = httpx.post(url + "/v1/completions", json={"prompt": "c", "max_tokens": 4, "temperature": 0})
        assert after.status_code == 200 and after.json()["choices"][0]["text"] == model.generate("c", max_tokens=4).text


def test_64_concurrent_streams_each_get_their_solo_tokens(model):
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randrange(1, 24))] for _ in range(64)]
    want = [model.generate(p, max_tokens=16, ignore_eos=True) for p in prompts]

    async def one(client, url, p):
        text, usage = "", None
        async with client.stream("POST", url + "/v1/completions", json={
                "prompt": p, "max_tokens": 16, "ignore_eos": True, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    text += "".join(c["text"] for c in chunk["choices"])
                    usage = chunk.get("usage") or usage
        return text, usage["completion_tokens"]

    async def all_of(url):
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(timeout=120, limits=limits) as client:
            return await asyncio.gather(*(one(client, url, p) for p in prompts))

    with slotinfer.Inferencer(model, slots=16, max_len=64, max_queue=64) as inf, serving(build_app(inf)) as url:
        got = asyncio.run(all_of(url))
    assert got == [(w.text, len(w.tokens)) for w in want]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_shuts_down_gracefully_with_exit_0(model_dir, sig):
    proc, url = _serve(model_dir, "--slots", "2", "--max-len", "2048", "--grace-period", "2")
    try:
        assert httpx.get(url + "/health").status_code == 200
        with httpx.stream("POST", url + "/v1/completions", json={"prompt": "go", "stream": True, **LONG},
                          timeout=60) as r:
            lines = r.iter_lines()
            next(lines)
            proc.send_signal(sig)
            rest = [line for line in lines if line]  # in flight: ended after the grace period, not cut
        assert rest[-1] == "data: [DONE]"
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stderr.close()


def test_bench_serve_drives_the_server_and_the_inferencer_alike(model_dir, capsys, tmp_path):
    from slotinfer.cli.main import main

    plot = tmp_path / "serve.svg"
    assert main(["bench", "--serve", "--model", str(model_dir("qwen3")), "--clients", "3", "--requests", "2",
                 "--gen-tokens", "5", "--prompt-tokens", "8", "--plot", str(plot)]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.split()[:1] == ["3"]]
    assert [r[1] for r in rows] == ["server", "in-process", "in-process", "server", "ratio"]
    assert all(float(r[2]) > 0 for r in rows[:4]) and rows[4][-1].endswith("x")
    svg = plot.read_text()  # one point per client count and side, labelled
    assert svg.startswith("<svg") and svg.count("<circle") == 2 and "in-process Inferencer" in svg


def test_bench_serve_counts_every_token_on_both_sides(model):
    from slotinfer.cli.bench_serve import drive_http, drive_inferencer, workload

    prompts = workload(3, 2, 8, model.tokenizer.vocab_size)
    with slotinfer.Inferencer(model, slots=3, max_len=32) as inf, serving(build_app(inf)) as url:
        for r in (asyncio.run(drive_http(url, None, prompts, 5)), asyncio.run(drive_inferencer(inf, prompts, 5))):
            assert round(r["tokens_per_s"] * r["wall_s"]) == 3 * 2 * 5
            assert 0 < r["ttft_p50"] <= r["ttft_p95"] < r["wall_s"] and 0 < r["itl_p50"] <= r["itl_p95"]


def test_classify_beside_running_streams_changes_neither(model):
    from concurrent.futures import ThreadPoolExecutor

    rng = random.Random(1)
    prompts = [[rng.randrange(3, 512) for _ in range(10)] for _ in range(8)]
    want = [model.generate(p, max_tokens=30, ignore_eos=True).text for p in prompts]
    texts = ["good food", "a bad day", "fine"] * 6
    want_cls = model.classify(texts, labels=["yes", "no"], prefix="Q: ")
    with slotinfer.Inferencer(model, slots=4, max_len=64) as inf, serving(build_app(inf)) as url:
        def gen(p):
            body = {"prompt": p, "max_tokens": 30, "ignore_eos": True, "temperature": 0}
            return httpx.post(url + "/v1/completions", json=body, timeout=120).json()["choices"][0]["text"]

        def cls(_):
            body = {"input": texts, "labels": ["yes", "no"], "prefix": "Q: "}
            return httpx.post(url + "/v1/classify", json=body, timeout=120).json()["data"]

        with ThreadPoolExecutor(12) as ex:
            got = ex.map(gen, prompts)
            got_cls = list(ex.map(cls, range(4)))
            got = list(got)
    assert got == want
    for data in got_cls:
        assert [d["label"] for d in data] == [w.label for w in want_cls]
        assert [d["scores"]["yes"] for d in data] == pytest.approx([w.scores["yes"] for w in want_cls], abs=1e-4)


def _serve(model_dir, *flags):
    """``slotinfer serve`` on the tiny model in a child process: (process, base url)."""
    proc = subprocess.Popen([sys.executable, "-m", "slotinfer", "serve", str(model_dir("qwen3")), "--port", "0",
                             *flags], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    for line in proc.stderr:
        m = re.search(r"running on (http://127\.0\.0\.1:\d+)", line)
        if m:
            return proc, m.group(1)
    proc.kill()
    raise AssertionError("the server did not report its address: " + proc.stderr.read())


def test_the_server_compiles_its_steps_before_its_address_and_counts_none_of_it(model_dir):
    """``serve --model M --prefill-tokens N`` (the flags every other command and docs/serve.md use) runs
    one short request before it prints its address, so the first client does not wait for MLX to
    compile the steps; /metrics counts only what clients send."""
    proc = subprocess.Popen([sys.executable, "-m", "slotinfer", "serve", "--model", str(model_dir("qwen3")),
                             "--prefill-tokens", "128", "--port", "0", "--slots", "2", "--max-len", "256"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        before = []
        for line in proc.stderr:
            m = re.search(r"running on (http://127\.0\.0\.1:\d+)", line)
            if m:
                break
            before.append(line)
        assert m, "".join(before)
        assert any(re.match(r"slotinfer serve: prefill and decode steps compiled in \d+\.\d s$", b) for b in before)
        url = m.group(1)
        metrics = httpx.get(url + "/metrics").text
        for name in ("prefix_cache_queries_total", "decode_tokens_per_second", "prefill_tokens_per_second",
                     "preempted_total"):
            assert f"slotinfer_{name} 0.0" in metrics, name
        assert httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 3}).status_code == 200
        metrics = httpx.get(url + "/metrics").text
        assert 'slotinfer_requests_total{endpoint="completions",outcome="ok"} 1.0' in metrics
        assert float(re.search(r"^slotinfer_decode_tokens_per_second (\S+)$", metrics, re.M)[1]) > 0
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        proc.stderr.close()


def test_past_the_grace_period_every_request_ends_once_with_its_answer(model_dir):
    """Requests still running when --grace-period runs out end as docs/serve.md says: a stream with an
    error event and [DONE], a whole request (a classify too) with a JSON 503; no traceback, and exit 0."""
    proc, url = _serve(model_dir, "--slots", "4", "--max-len", "2048", "--grace-period", "1")
    try:
        whole = {}
        t = threading.Thread(target=lambda: whole.update(r=httpx.post(url + "/v1/completions", timeout=60,
                                                                      json={"prompt": "a", **LONG})))
        c = threading.Thread(target=lambda: whole.update(c=httpx.post(url + "/v1/classify", timeout=60,
                                                                      json=_classify_body(600))))
        t.start()
        c.start()
        with httpx.stream("POST", url + "/v1/chat/completions", timeout=60, json={
                "messages": [{"role": "user", "content": "b"}], "stream": True, **LONG}) as s:
            lines = s.iter_lines()
            next(lines)
            _until(lambda: "slotinfer_requests_running 2.0" in httpx.get(url + "/metrics").text)
            proc.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line]
        t.join(60)
        c.join(60)
        assert rest[-1] == "data: [DONE]"
        last = json.loads(rest[-2][len("data: "):])
        assert (last["error"]["code"], last["error"]["type"]) == ("shutting_down", "server_error")
        for r in whole.values():  # a whole completion, a classify stopped between two batches
            assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down", r.text
        assert proc.wait(timeout=60) == 0
        log = proc.stderr.read()
        assert "Traceback" not in log and "CancelledError" not in log and "Cancel" not in log, log
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stderr.close()


def test_a_huge_prompt_is_tokenized_off_the_event_loop(model):
    """Tokenizing a prompt of megabytes takes seconds: meanwhile /health answers at once (the gaps between
    answers are measured, so that a client thread held up in this process counts too)."""
    text = "the quick brown fox jumps over the lazy dog; " * 50_000  # 2.2 MB
    t0 = time.perf_counter()
    model.tokenizer.encode(text)
    alone = time.perf_counter() - t0
    with slotinfer.Inferencer(model, slots=1, max_len=64) as inf, \
            serving(build_app(inf, max_body_bytes=16 << 20)) as url:
        out = {}
        t = threading.Thread(target=lambda: out.update(r=httpx.post(url + "/v1/completions", timeout=120,
                                                                    json={"prompt": text, "max_tokens": 1})))
        answered = [time.perf_counter()]
        t.start()
        with httpx.Client(timeout=120) as c:
            while t.is_alive():
                assert c.get(url + "/health").status_code == 200
                answered.append(time.perf_counter())
                time.sleep(0.02)
        t.join()
    assert out["r"].status_code == 400 and out["r"].json()["error"]["code"] == "context_length_exceeded"
    worst = max(b - a for a, b in zip(answered, answered[1:]))
    assert alone > 1.0 and worst < alone / 4, (alone, worst)


def test_a_request_that_can_never_fit_is_400_before_tokenizing(model):
    """More rows than slots + queue bound could ever hold: a 400 naming n or prompt, never a 429 that a
    client would retry forever; a request of exactly that many rows runs on an idle server."""
    too_long = "word " * 5000  # tokenized first, it would be context_length_exceeded
    with slotinfer.Inferencer(model, slots=2, max_len=64, max_queue=2) as inf, serving(build_app(inf)) as url:
        r = httpx.post(url + "/v1/completions", json={"prompt": too_long, "n": 5, "max_tokens": 1})
        assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text
        assert "2 slots" in r.json()["error"]["message"] and "2 queued" in r.json()["error"]["message"]
        r = httpx.post(url + "/v1/completions", json={"prompt": [too_long] * 5, "max_tokens": 1})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
        r = httpx.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "n": 5})
        assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text
        for _ in range(5):
            r = httpx.post(url + "/v1/completions", json={"prompt": ["a", "b"], "n": 2, "max_tokens": 2}, timeout=60)
            assert r.status_code == 200 and len(r.json()["choices"]) == 4, r.text


def test_a_body_that_does_not_arrive_in_time_is_408_and_the_socket_closed(model):
    with slotinfer.Inferencer(model, slots=1, max_len=64) as inf, serving(build_app(inf, read_timeout=0.5)) as url:
        port = int(url.rsplit(":", 1)[1])
        s = socket.create_connection(("127.0.0.1", port), timeout=10)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 100\r\n\r\n{\"prompt\": ")  # and then nothing (slowloris)
        t0 = time.monotonic()
        got = b""
        while chunk := s.recv(4096):
            got += chunk
        s.close()
        assert got.startswith(b"HTTP/1.1 408") and b'"request_timeout"' in got, got
        assert time.monotonic() - t0 < 5
        assert httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 1}).status_code == 200


def _classify_body(inputs: int, rng=random.Random(5)):
    words = ["good", "bad", "food", "day", "nice", "the", "a", "movie", "was", "not"]
    return {"input": [" ".join(rng.choice(words) for _ in range(20)) for _ in range(inputs)], "prefix": "Q: ",
            "labels": ["very good", "quite bad", "not sure at all", "maybe later", "good day", "bad food", "all the way",
                       "on the other hand"]}


def test_classify_past_its_limits_is_400_before_any_work(model):
    from slotinfer.serve.schemas import ClassifyLimits

    limits = ClassifyLimits(inputs=8, labels=3, tokens=200)
    with slotinfer.Inferencer(model, slots=1, max_len=64) as inf, \
            serving(build_app(inf, classify_limits=limits)) as url:
        for body, param, figure in [
                ({"input": ["a"] * 9, "labels": ["x", "y"]}, "input", "8"),
                ({"input": ["a"], "labels": ["w", "x", "y", "z"]}, "labels", "3"),
                ({"input": ["a b c d e f g h i j"] * 8, "labels": ["x", "y"], "prefix": "p " * 200}, "prefix", "200"),
                ({**_classify_body(8), "labels": ["x", "y"]}, "input", "200"),
                ({"input": ["a"] * 8, "labels": ["x", "y", "yes yes yes yes yes yes yes yes " * 4]}, "labels", "200")]:
            r = httpx.post(url + "/v1/classify", json=body, timeout=60)
            err = r.json()["error"]
            assert r.status_code == 400 and err["param"] == param and figure in err["message"], (body, r.text)
        assert httpx.post(url + "/v1/classify", json={"input": ["a"] * 8, "labels": ["x", "y"]}).status_code == 200
    with slotinfer.Inferencer(model, slots=1, max_len=64) as inf, serving(build_app(inf)) as url:  # the defaults
        r = httpx.post(url + "/v1/classify", json={"input": ["a"] * 2049, "labels": ["x", "y"]}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "input" and "2048" in r.text


def test_a_classify_whose_client_left_stops_at_its_next_batch(model):
    """A classify of ~10 s whose client goes away after 1 s frees the classifier for the next one."""
    from slotinfer.serve.schemas import ClassifyLimits

    big = json.dumps(_classify_body(2048)).encode()
    with slotinfer.Inferencer(model, slots=1, max_len=64) as inf, \
            serving(build_app(inf, classify_limits=ClassifyLimits(tokens=1 << 20))) as url:
        s = socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])))
        s.sendall(b"POST /v1/classify HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n" % len(big) + big)
        time.sleep(1.5)
        s.close()
        t0 = time.monotonic()
        r = httpx.post(url + "/v1/classify", json={"input": ["fine"], "labels": ["yes", "no"]}, timeout=120)
        assert r.status_code == 200 and time.monotonic() - t0 < 2, time.monotonic() - t0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_what_a_huge_prompt_took_is_given_back(model_dir):
    """Tokenizing 4 MB takes hundreds of MB, which glibc would keep for good: the server's RSS after
    the request is within 250 MiB of before (it was ~600 MiB over)."""
    proc, url = _serve(model_dir, "--slots", "2", "--max-len", "64", "--max-body-bytes", str(16 << 20))
    rss = lambda: int(re.search(r"VmRSS:\s+(\d+)", Path(f"/proc/{proc.pid}/status").read_text())[1]) >> 10  # noqa
    try:
        assert httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200
        before = rss()
        r = httpx.post(url + "/v1/completions", json={"prompt": "the quick brown fox; " * 200_000, "max_tokens": 1},
                       timeout=120)
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
        assert rss() - before < 250, (before, rss())
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        proc.stderr.close()


@pytest.mark.parametrize("flags,cached", [(["--prefix-cache-bytes", "64MiB", "--kv-dtype", "float16"], True),
                                          (["--no-prefix-cache"], False)])
def test_the_prefix_cache_flags(model_dir, flags, cached):
    proc, url = _serve(model_dir, "--slots", "2", "--max-len", "256", *flags)
    body = {"prompt": "a long shared instruction " * 12 + "then a question", "max_tokens": 2}
    try:
        got = [httpx.post(url + "/v1/completions", json=body, timeout=60).json()["usage"] for _ in range(2)]
        metrics = httpx.get(url + "/metrics").text
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        proc.stderr.close()
    assert got[0]["prompt_tokens_details"]["cached_tokens"] == 0
    assert (got[1]["prompt_tokens_details"]["cached_tokens"] > 0) == cached
    assert ("slotinfer_prefix_cache_budget_bytes 6.7108864e+07" in metrics) == cached


@pytest.mark.parametrize("text,value", [("2GiB", 2 << 30), ("512MiB", 512 << 20), ("1.5GB", 1_500_000_000),
                                        ("1000", 1000), ("0", 0)])
def test_byte_sizes(text, value):
    from slotinfer.cli.common import byte_size

    assert byte_size(text) == value


@pytest.mark.parametrize("text", ["", "GiB", "-1GiB", "2 parsecs", "nan", "inf"])
def test_bad_byte_sizes_are_usage_errors(text):
    import argparse

    from slotinfer.cli.common import byte_size

    with pytest.raises(argparse.ArgumentTypeError, match="size"):
        byte_size(text)


def test_kv_cache_bytes_sizes_the_servers_pool(model_dir):
    """``--kv-cache-bytes`` of three 128-token blocks (two reserved) on the tiny model (256 KiB a
    block): /metrics says one free block, a request that needs more gets 400 naming max_tokens and
    one that fits is served; 0 is refused at start."""
    proc, url = _serve(model_dir, "--slots", "2", "--max-len", "512", "--kv-cache-bytes", "768KiB")
    try:
        metrics = httpx.get(url + "/metrics").text
        assert "slotinfer_kv_blocks_free 1.0" in metrics and "slotinfer_kv_blocks_used 0.0" in metrics
        r = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 300}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
        ok = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 3}, timeout=60)
        assert ok.status_code == 200
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    bad = subprocess.run([sys.executable, "-m", "slotinfer", "serve", str(model_dir("qwen3")), "--port", "0",
                          "--kv-cache-bytes", "0"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--kv-cache-bytes" in bad.stderr
