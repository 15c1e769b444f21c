"""The Ray Serve application on a real local Ray cluster (2 CPUs): two replicas of a tiny model behind
the ingress, driven by the ``openai`` client, against one ``slotinfer serve`` over the same model."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import httpx
import openai
import pytest

ray = pytest.importorskip("ray", reason="Ray Serve is the optional extra slotinfer[ray]")
serve = pytest.importorskip("ray.serve")
pytestmark = pytest.mark.slow  # a local Ray cluster, a Serve application

import slotinfer  # noqa: E402
import slotinfer.ray as sr  # noqa: E402
from slotinfer.cli.main import main  # noqa: E402
from slotinfer.serve import build_app  # noqa: E402
from slotinfer.serve.app import shell_app  # noqa: E402
from slotinfer.serve.backend import LocalBackend  # noqa: E402
from slotinfer.serve.background import serving  # noqa: E402
from slotinfer.serve.ray_app import Dispatcher, build  # noqa: E402
from slotinfer.serve.remote import RemoteBackend  # noqa: E402

NAME = "qwen3"  # the tiny model's folder: its name in the API
SLOTS, QUEUE, MAX_LEN = 4, 4, 256
ENGINE = dict(slots=SLOTS, max_queue=QUEUE, max_len=MAX_LEN)
WORDS = "the cat sat on a mat while rain fell over quiet hills and old roads near the sea".split()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def model_path(model_dir):
    return str(model_dir("qwen3"))


@pytest.fixture(scope="module")
def model(model_path):
    return slotinfer.load(model_path)


@pytest.fixture(scope="module")
def fleet(model_path):
    """The application's base URL: 2 replicas (half a CPU each) and the ingress, on 2 CPUs."""
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(sr.serve_app(model_path, replicas=2, num_cpus=0.5, ingress_cpus=0.25, **ENGINE),
              name="slotinfer", route_prefix="/")
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()
    ray.shutdown()


@pytest.fixture(scope="module")
def client(fleet):
    return openai.OpenAI(base_url=fleet + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def single(model):
    """One ``slotinfer serve`` (the same app, in this process) over the same model."""
    with slotinfer.Inferencer(model, **ENGINE) as inf, serving(build_app(inf, served_model_name=NAME)) as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _system(i: int, words: int = 60) -> str:
    return " ".join(WORDS[(i * 5 + j) % len(WORDS)] for j in range(words))


def test_greedy_outputs_equal_one_servers(client, single):
    assert [m.id for m in client.models.list().data] == [NAME]
    prompts = ["Once upon a time", "The sea"]
    got = client.completions.create(model=NAME, prompt=prompts, max_tokens=12, temperature=0, n=2)
    want = single.completions.create(model=NAME, prompt=prompts, max_tokens=12, temperature=0, n=2)
    assert [(c.index, c.text, c.finish_reason) for c in got.choices] == \
           [(c.index, c.text, c.finish_reason) for c in want.choices]
    assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (want.usage.prompt_tokens,
                                                                      want.usage.completion_tokens)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    got = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=10, temperature=0)
    want = single.chat.completions.create(model=NAME, messages=msgs, max_tokens=10, temperature=0)
    assert got.choices[0].message.content == want.choices[0].message.content
    with pytest.raises(openai.NotFoundError) as e:  # the same error shapes as one server's
        client.completions.create(model="nope", prompt="x", max_tokens=2)
    assert e.value.body["code"] == "model_not_found" and NAME in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=NAME, prompt="x", max_tokens=2, temperature=-1)
    assert e.value.body["param"] == "temperature"
    page = httpx.get(str(client.base_url).removesuffix("/v1/") + "/metrics").text
    assert 'slotinfer_requests_total{endpoint="completions",outcome="ok"} 1.0' in page


def test_streams_are_well_formed(client, single):
    msgs = [{"role": "user", "content": "Tell me about the sea."}]
    kw = dict(model=NAME, messages=msgs, max_tokens=16, temperature=0, extra_body={"ignore_eos": True})
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    whole = single.chat.completions.create(**kw)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16
    assert len({c.id for c in chunks}) == 1
    # four rows in one call to one replica: their tokens interleave and reach the ingress in batches;
    # each row's streamed text is still its whole answer, in order, none lost
    kw = dict(model=NAME, prompt=["Once upon a time", "The sea"], n=2, max_tokens=24, temperature=0)
    texts: dict[int, str] = {}
    for c in client.completions.create(stream=True, extra_body={"ignore_eos": True}, **kw):
        for ch in c.choices:
            texts[ch.index] = texts.get(ch.index, "") + ch.text
    whole = single.completions.create(extra_body={"ignore_eos": True}, **kw)
    assert texts == {c.index: c.text for c in whole.choices}


def test_the_other_routes_run_on_the_replicas(fleet, model):
    """Classify and embeddings are jobs on a replica; Anthropic Messages rides the same rows as chat."""
    r = httpx.post(fleet + "/v1/classify", json={"input": ["a cat", "the sea"], "labels": ["yes", "no"]}, timeout=60)
    assert [d["label"] for d in r.json()["data"]] == [c.label for c in model.classify(["a cat", "the sea"],
                                                                                       labels=["yes", "no"])]
    r = httpx.post(fleet + "/v1/embeddings", json={"input": ["a cat"]}, timeout=60)
    assert r.json()["data"][0]["embedding"] == pytest.approx([float(x) for x in model.embed(["a cat"])[0]], abs=1e-4)
    r = httpx.post(fleet + "/v1/messages", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
                   timeout=60)
    assert r.status_code == 200 and r.json()["type"] == "message" and 1 <= r.json()["usage"]["output_tokens"] <= 4


def test_a_replica_holds_a_streams_tokens_to_send_them_together(fleet, model):
    """By default a replica holds a streamed row's tokens 50 ms after the first and sends what came
    meanwhile as one message: fewer messages than tokens, the tokens all there in order."""
    handle = serve.get_deployment_handle("slotinfer-qwen3", app_name="slotinfer")
    row = (model.encode_prompt(_system(5, 4)), {"max_tokens": 24, "ignore_eos": True})

    async def read():
        return [item async for item in handle.options(stream=True).generate.remote([row])]

    items = asyncio.run(read())
    assert items[0][0] == "accepted" and items[-1][-1][0] == "stats"
    batches = [[ev.token for kind, _, ev in batch if kind == "event"] for batch in items[1:]]
    [done] = [c for batch in items[1:] for kind, _, c in batch if kind == "done"]
    assert batches[0] and sum(batches, []) == done.tokens and len(done.tokens) == 24
    assert len(batches) < 12, batches  # a 24-token row in a few messages: the tiny model decodes in ms


def test_a_chats_later_turns_land_where_its_first_did(client):
    """Four chats with distinct system prompts: each later turn finds its conversation's K/V in the cache
    of the replica that served the turn before (a blind balancer would miss about half of them)."""
    chats = [[{"role": "system", "content": _system(i)}, {"role": "user", "content": f"Question {i}?"}]
             for i in range(4)]
    for turn in range(3):
        for i, msgs in enumerate(chats):
            r = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=6, temperature=0)
            cached = r.usage.prompt_tokens_details.cached_tokens
            if turn:  # all of the earlier turn's prompt, but for its last partial block
                assert cached >= r.usage.prompt_tokens // 2, (turn, i, cached, r.usage.prompt_tokens)
            msgs += [{"role": "assistant", "content": r.choices[0].message.content},
                     {"role": "user", "content": f"And then {turn}?"}]


def test_a_full_fleet_answers_429_with_retry_after(fleet):
    """Twelve requests of two rows at once: the fleet holds 16 rows (2 x (4 slots + 4 queued)), each
    request whole on one replica; past that, 429 (never a request cut in part)."""
    body = {"model": NAME, "prompt": _system(9, 20), "max_tokens": MAX_LEN // 2, "ignore_eos": True, "n": 2}
    out, go = [], threading.Barrier(12)

    def send():
        go.wait()
        r = httpx.post(fleet + "/v1/completions", json=body, timeout=300)
        out.append((r.status_code, r.headers.get("retry-after"), r.json()))
        assert r.status_code != 400, r.json()

    threads = [threading.Thread(target=send) for _ in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    codes = sorted(code for code, _, _ in out)
    assert set(codes) <= {200, 429} and 429 in codes and 200 in codes, codes
    for code, retry, got in out:
        if code == 429:
            assert retry == "1" and got["error"]["code"] == "rate_limit_exceeded"
        else:
            assert len(got["choices"]) == 2 and got["usage"]["completion_tokens"] == MAX_LEN


def test_bad_configuration_is_a_clear_error_at_start(model_path, tmp_path, capsys):
    with pytest.raises(slotinfer.InvalidRequestError, match="replicas must be an int >= 1"):
        sr.serve_app(model_path, replicas=0)
    with pytest.raises(slotinfer.InvalidRequestError, match="autoscale"):
        sr.serve_app(model_path, autoscale=(3, 1))
    with pytest.raises(slotinfer.InvalidRequestError, match="stream_interval must be an int >= 1"):
        sr.serve_app(model_path, replicas=1, stream_interval=0)
    with pytest.raises(slotinfer.ModelNotFoundError, match="no model at"):
        sr.serve_app(str(tmp_path / "absent"), replicas=1)
    with pytest.raises(slotinfer.InvalidRequestError, match="need 'model'"):
        build({"replicas": 2})  # a Serve config file's args
    assert type(build({"model": model_path, "autoscale": [1, 2]})).__name__ == "Application"
    assert main(["serve", model_path, "--ray", "--ray-address", f"127.0.0.1:{_free_port()}"]) == 2
    assert "no Ray cluster answers" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["serve", model_path, "--ray", "--stream-interval", "0"])
    assert e.value.code == 2 and "--stream-interval" in capsys.readouterr().err
    for bad in (-1, "50", True, 20_000):
        with pytest.raises(slotinfer.InvalidRequestError, match="stream_hold_ms must be a number"):
            sr.serve_app(model_path, replicas=1, stream_hold_ms=bad)
    for argv in (["--ray", "--stream-hold-ms", "-5"], ["--stream-hold-ms", "10"]):
        with pytest.raises(SystemExit) as e:
            main(["serve", model_path, *argv])
        assert e.value.code == 2 and "--stream-hold-ms" in capsys.readouterr().err


def test_several_models_under_their_names(model):
    """The ingress's dispatcher: one shell per model, /v1/models lists them all, a request's model picks."""
    with slotinfer.Inferencer(model, **ENGINE) as a, slotinfer.Inferencer(model, **ENGINE) as b:
        names = ("first", "second")
        apps = {n: shell_app(LocalBackend(inf), model, n, served=names) for n, inf in zip(names, (a, b))}
        with serving(Dispatcher(apps)) as url:
            c = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
            assert [m.id for m in c.models.list().data] == list(names)
            assert c.models.retrieve("second").id == "second"
            for n, inf in zip(names, (a, b)):
                before = inf.stats()["submitted"]
                assert c.completions.create(model=n, prompt="Hi", max_tokens=3).model == n
                assert inf.stats()["submitted"] == before + 1
            with pytest.raises(openai.NotFoundError, match="'first', 'second'"):
                c.completions.create(model="third", prompt="Hi", max_tokens=3)


def _replica_actors():
    return [a for a in ray.util.list_named_actors(all_namespaces=True) if "slotinfer-qwen3" in a["name"]]


def _replicas() -> dict:
    """Each replica's :meth:`Replica.info`, by id, asked of that replica (a call pinned to it)."""
    handle = serve.get_deployment_handle("slotinfer-qwen3", app_name="slotinfer")
    ids = [a["name"].rsplit("#", 1)[-1] for a in _replica_actors()]
    return {i: handle.info.remote(pin=i).result(timeout_s=60) for i in ids}


def _settled(until, timeout: float = 30.0) -> dict:
    """The replicas' infos once ``until(infos)`` holds (or, past ``timeout`` seconds, as they are)."""
    deadline = time.monotonic() + timeout
    while True:
        infos = _replicas()
        if until(infos) or time.monotonic() > deadline:
            return infos
        time.sleep(0.2)


def _live(infos: dict) -> int:
    return sum(i["stats"]["active_slots"] + i["stats"]["waiting"] for i in infos.values())


def test_pinned_calls_reach_their_replica(fleet, model_path, model):
    """Each router sends a call pinned to a replica there, among unpinned calls routed at the same time:
    the prefix router here, and Serve's own power of two choices (whose waiting requests are served in
    order, any replica found going to the first) in an application of its own, whose replicas send
    tokens two a message (``stream_interval=2``)."""
    infos = _replicas()
    assert len(infos) == 2 and all(i["replica"] == rid for rid, i in infos.items())
    serve.run(sr.serve_app(model_path, replicas=2, routing="pow2", num_cpus=0.25, ingress_cpus=0.25, stream_interval=2,
                           **ENGINE),
              name="pow2", route_prefix="/pow2")
    try:
        handle = serve.get_deployment_handle("slotinfer-qwen3", app_name="pow2")
        ids = {handle.info.remote().result(timeout_s=60)["replica"] for _ in range(20)}
        assert len(ids) == 2, ids  # the unpinned calls went to both
        rows = [(model.encode_prompt(_system(i, 6)), {"max_tokens": 8, "ignore_eos": True}) for i in range(8)]

        async def burst():  # rounds of 4 calls at once (the handle queues 4 at most)
            got = []
            for k in range(0, len(rows), 2):
                unpinned = [handle.options(stream=True).generate.remote([row]) for row in rows[k:k + 2]]
                pinned = [(i, handle.info.remote(pin=i)) for i in sorted(ids)]
                got += [(i, (await r)["replica"]) for i, r in pinned]
                for gen in unpinned:
                    items = [item async for item in gen]  # read to the end: the rows finish
                    assert items[0] == ("accepted", items[-1][-1][1]) and items[-1][-1][0] == "stats"
                    tokens = [ev.token for batch in items[1:] for kind, _, ev in batch if kind == "event"]
                    [done] = [c for batch in items[1:] for kind, _, c in batch if kind == "done"]
                    assert tokens == done.tokens and len(tokens) == 8
                    # stream_interval=2: after the first token, two a message (fewer if a step is slow)
                    assert len(items) - 1 < len(tokens), items
            return got

        got = asyncio.run(burst())
        assert all(want == there for want, there in got), got
    finally:
        serve.delete("pow2")


def test_a_client_that_leaves_frees_its_rows_on_the_replica(fleet, client):
    """A streamed request of two rows whose client disconnects: its rows stop on the replica (not only at
    the ingress) while a request beside it runs to its end."""
    before = _settled(lambda infos: _live(infos) == 0)
    assert _live(before) == 0, before
    other = {}
    beside = threading.Thread(target=lambda: other.update(r=client.completions.create(
        model=NAME, prompt=_system(3, 10), max_tokens=MAX_LEN // 2, temperature=0, extra_body={"ignore_eos": True})))
    beside.start()
    body = {"model": NAME, "prompt": _system(4, 10), "n": 2, "max_tokens": MAX_LEN - 32, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", fleet + "/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        assert sum(line.startswith("data: {") for line, _ in zip(lines, range(4))) >= 2
    # the client left after a few tokens of each of its rows, long before their end
    cancelled = sum(i["rows_cancelled"] for i in before.values()) + 2
    after = _settled(lambda infos: sum(i["rows_cancelled"] for i in infos.values()) >= cancelled
                     and all(i["calls"] == 0 for i in infos.values()) or not beside.is_alive() and _live(infos) == 0)
    beside.join(120)
    assert sum(i["rows_cancelled"] for i in after.values()) == cancelled, after
    assert other["r"].usage.completion_tokens == MAX_LEN // 2 and other["r"].choices[0].finish_reason == "length"
    assert _live(_settled(lambda infos: _live(infos) == 0)) == 0


def test_one_cancelled_row_stops_on_its_replica(fleet, model):
    """Of a call's two rows, one is cancelled at the ingress: a call pinned to the replica stops it there,
    at the engine's next step, and the other row runs on to its end."""
    prompt = model.encode_prompt(_system(5, 10))
    params = {"max_tokens": MAX_LEN - 32, "ignore_eos": True, "temperature": 0}

    async def run():
        handle = serve.get_deployment_handle("slotinfer-qwen3", app_name="slotinfer")
        backend = RemoteBackend(handle, await handle.info.remote())
        first, second = await backend.submit([(prompt, params), (prompt, params)])
        replica = first.call.replica
        began = (await handle.info.remote(pin=replica))["rows_cancelled"]
        await anext(aiter(first))
        assert first.cancel() and first.done() and first.result().finish_reason == "cancelled"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            info = await handle.info.remote(pin=replica)
            if info["rows_cancelled"] > began:
                break
            await asyncio.sleep(0.1)
        tokens = [ev.token async for ev in second]
        # both rows of a call cancelled at once: the call itself ends, and its rows on the replica.  The
        # tiny model makes a row's 224 tokens in well under a second, so on a loaded machine the cancel can
        # reach the replica after the rows ended by themselves (nothing left to stop): up to 3 tries
        for _ in range(3):
            rows = await backend.submit([(prompt, params), (prompt, params)])
            replica, began_both = rows[0].call.replica, (await handle.info.remote(pin=rows[0].call.replica))
            await anext(aiter(rows[1]))
            for r in rows:
                r.cancel()
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                both = await handle.info.remote(pin=replica)
                if both["calls"] == 0:
                    break
                await asyncio.sleep(0.1)
            stopped = both["rows_cancelled"] - began_both["rows_cancelled"]
            if stopped == 2:
                break
        return info, began, second.result(), tokens, stopped

    info, began, done, tokens, stopped = asyncio.run(run())
    assert info["rows_cancelled"] == began + 1 and info["calls"] == 1, info  # stopped there; the other ran on
    assert done.finish_reason == "length" and len(done.tokens) == MAX_LEN - 32 and tokens == done.tokens
    assert stopped == 2


def test_a_dying_replica_loses_no_unstarted_request(client):
    """Streams run on both replicas; one replica is killed: its streams end with an error event, the others
    finish, and requests sent right after (some routed to the dead replica before the router knows) all
    succeed on the one left while Serve starts another."""
    results, started = {}, threading.Semaphore(0)

    def stream(i):
        n = 0
        try:
            s = client.completions.create(model=NAME, prompt=_system(i, 10), max_tokens=MAX_LEN // 2, temperature=0,
                                          stream=True, extra_body={"ignore_eos": True})
            for _ in s:
                n += 1
                if n == 1:
                    started.release()
                time.sleep(0.01)  # slow readers: the streams are still running when the replica dies
            results[i] = ("ok", n)
        except openai.APIError as e:
            results[i] = ("error", str(e))
        finally:
            if n == 0:  # ended before its first token: the wait below must not outlast it
                started.release()

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(6)]
    for t in threads:  # one at a time, each once the one before has its first token: the router then knows
        t.start()      # where the streams run and sends each to the replica with fewer, 3 on each
        assert started.acquire(timeout=180), results  # (started together, all could land on the replica spared)
    [victim] = _replica_actors()[:1]
    ray.kill(ray.get_actor(victim["name"], namespace=victim["namespace"]), no_restart=True)
    after = [client.completions.create(model=NAME, prompt=_system(20 + i, 8), max_tokens=4, temperature=0)
             for i in range(6)]
    for t in threads:
        t.join(120)
    assert all(len(r.choices[0].text) >= 0 and r.usage.completion_tokens == 4 for r in after)
    errors = [m for kind, m in results.values() if kind == "error"]
    assert len(results) == 6 and errors, results  # the streams of the dead replica ended with an error event
    assert all("replica" in m for m in errors), errors
    assert any(kind == "ok" for kind, _ in results.values()), results  # the other replica's finished
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # Serve starts another in its place
        names = {a["name"] for a in _replica_actors() if a["name"] != victim["name"]}
        if len(names) == 2:
            break
        time.sleep(0.5)
    assert len(names) == 2, names
