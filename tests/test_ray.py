"""slotinfer.ray on a real local Ray cluster: 2 actors, a tiny model, the same rows as the single-process APIs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

ray = pytest.importorskip("ray", reason="Ray Data is the optional extra slotinfer[ray]")
# Ray Data's own defaults set options it deprecates, each time it builds its context: nothing slotinfer does
pytestmark = [pytest.mark.slow,  # a local Ray cluster and a Ray job
              pytest.mark.filterwarnings("ignore::DeprecationWarning:ray.data.context")]
pq = pytest.importorskip("pyarrow.parquet")

import slotinfer  # noqa: E402
import slotinfer.ray as sr  # noqa: E402
from slotinfer.cli.main import main  # noqa: E402
from slotinfer.testing import make_tiny_model  # noqa: E402

LABELS = ["yes", "no", "maybe"]
PREFIX = "Question: is this true? "
CONTEXT = 256
WORDS = "the cat sat on a mat while rain fell over quiet hills and old roads".split()


def _sentences(n):
    return [" ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(3 + i % 9)) for i in range(n)]


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    # a short context, so that a long row is too long for it
    return str(make_tiny_model("qwen3", tmp_path_factory.mktemp("ray") / "qwen3",
                               overrides={"max_position_embeddings": CONTEXT}))


@pytest.fixture(scope="module")
def model(model_path):
    return slotinfer.load(model_path)


def _run(ds, cls, **kw):
    out = ds.map_batches(cls, fn_constructor_kwargs={"worker_column": "worker", **kw}, batch_size=4,
                         batch_format="pyarrow", **sr.actor_options(2, cores=2))
    return sorted(out.take_all(), key=lambda r: r["id"])


def test_classifier_rows_equal_classify_and_both_actors_work(cluster, model_path, model):
    texts = _sentences(24)
    bad = {5: "", 11: None, 17: "word " * 400}  # empty, missing, longer than the context
    rows = [{"id": i, "text": bad.get(i, t), "source": f"doc-{i}"} for i, t in enumerate(texts)]
    ds = ray.data.from_items(rows, override_num_blocks=6)
    got = _run(ds, sr.Classifier, model=model_path, labels=LABELS, prefix=PREFIX)

    good = [i for i in range(24) if i not in bad]
    want = model.classify([texts[i] for i in good], labels=LABELS, prefix=PREFIX)
    assert [r["id"] for r in got] == list(range(24))
    assert all(r["source"] == f"doc-{r['id']}" and r["text"] == rows[r["id"]]["text"] for r in got)  # passed through
    for i, w in zip(good, want):
        r = got[i]
        assert r["error"] is None and r["label"] == w.label, (i, r)
        assert r["scores"] == pytest.approx(w.scores, abs=1e-4)  # batches padded differently: float tolerance
    assert "empty" in got[5]["error"] and "missing" in got[11]["error"]
    assert got[17]["error"].startswith("PromptTooLongError") and str(CONTEXT) in got[17]["error"]
    assert all(got[i]["label"] is None and got[i]["scores"] is None for i in bad)
    assert len({r["worker"] for r in got}) == 2


def test_generator_rows_equal_batch_generate_greedy(cluster, model_path, model):
    # 10 batches: enough work that both actors are up before it runs out (with 5, a fast first actor
    # could take every batch while the second was still loading the model)
    prompts = _sentences(40)
    bad = {3: "", 14: "word " * 100}  # empty; longer than the table's max_len of 64 with max_tokens
    rows = [{"id": i, "text": bad.get(i, p)} for i, p in enumerate(prompts)]
    ds = ray.data.from_items(rows, override_num_blocks=10)
    got = _run(ds, sr.Generator, model=model_path, max_tokens=8, slots=4, max_len=64)

    good = [i for i in range(40) if i not in bad]
    want = model.batch_generate([prompts[i] for i in good], max_tokens=8)
    for i, w in zip(good, want):
        r = got[i]
        assert r["error"] is None, r
        assert (r["tokens"], r["text"], r["finish_reason"]) == (w.tokens, w.text, w.finish_reason), i
        assert r["prompt"] == prompts[i]  # the input column `text` is kept as `prompt`
    assert "empty" in got[3]["error"] and got[14]["error"].startswith("PromptTooLongError")
    assert all(got[i]["tokens"] == [] and got[i]["text"] is None for i in bad)
    assert len({r["worker"] for r in got}) == 2


def test_generator_batches_in_flight_share_one_slot_table(model_path):
    """Batches the actor runs at once (as Ray Data's async path does) decode together in one engine."""
    import asyncio

    import pyarrow as pa

    gen = sr.Generator(model_path, column="prompt", max_tokens=12, ignore_eos=True, slots=4, max_len=48)

    async def two_batches():
        return await asyncio.gather(gen(pa.table({"prompt": ["one two", "three four five"]})),
                                    gen(pa.table({"prompt": ["six", "seven eight"]})))

    for out in asyncio.run(two_batches()):
        assert out.column("error").to_pylist() == [None, None]
        assert [len(t) for t in out.column("tokens").to_pylist()] == [12, 12]
    stats = gen.inferencer.engine.counters
    assert stats["submitted"] == 4
    # one batch at a time would decode 2 rows a step; together the 4 rows fill the 4 slots
    assert stats["occupancy"] / stats["steps"] > 3, dict(stats)
    gen.inferencer.close()


def test_an_input_column_is_never_overwritten(model_path):
    import pyarrow as pa

    clf = sr.Classifier(model_path, labels=["yes", "no"])
    with pytest.raises(slotinfer.InvalidRequestError, match="already has column.*error"):
        clf(pa.table({"text": ["a b"], "error": ["from an earlier step"]}))


def test_bad_job_options_fail_before_any_row(model_path):
    with pytest.raises(slotinfer.InvalidRequestError, match="label"):
        sr.Classifier(model_path, labels=["yes", ""])
    with pytest.raises(slotinfer.InvalidRequestError, match="temperature"):
        sr.Generator(model_path, temperature=-1.0)
    with pytest.raises(slotinfer.InvalidRequestError, match="unknown generation parameter.*max_tokenz"):
        sr.Generator(model_path, max_tokenz=4)
    with pytest.raises(slotinfer.InvalidRequestError, match="unknown classify parameter.*budget"):
        sr.Classifier(model_path, labels=["yes", "no"], budget=64)
    with pytest.raises(slotinfer.InvalidRequestError, match="actors"):
        sr.actor_options(0)


def test_actor_options_share_the_cores():
    opts = sr.actor_options(2, device="cpu", cores=8)
    assert opts["num_cpus"] == 3.5 and opts["runtime_env"]["env_vars"]["SLOTINFER_BLAS_THREADS"] == "4"
    assert opts["compute"].min_size == opts["compute"].max_size == 2


@given(actors=st.integers(1, 64), cores=st.integers(1, 256), nodes=st.integers(1, 16))
def test_actor_options_never_oversubscribe_a_node(actors, cores, nodes):
    opts = sr.actor_options(actors, device="cpu", cores=cores, nodes=nodes)
    threads = int(opts["runtime_env"]["env_vars"]["SLOTINFER_BLAS_THREADS"])
    per_node = -(-actors // nodes)  # Ray Data spreads the pool: at most this many actors on a node
    assert threads >= 1 and (threads * per_node <= cores or threads == 1)
    # a node's actors fit on it and leave a CPU for reading and writing (where the node has two)
    assert per_node * opts["num_cpus"] <= max(cores - 1, 1) + 1e-9
    # and use its cores: one actor a node runs a thread per core
    assert per_node > 1 or threads == cores


def test_actor_options_one_actor_a_node_takes_the_node():
    opts = sr.actor_options(2, device="cpu", cores=8, nodes=2)
    assert opts["num_cpus"] == 7 and opts["runtime_env"]["env_vars"]["SLOTINFER_BLAS_THREADS"] == "8"
    with pytest.raises(slotinfer.InvalidRequestError, match="nodes"):
        sr.actor_options(2, device="cpu", nodes=0)


def _classify_cli(args):
    try:
        return main(["classify", *map(str, args)])
    except SystemExit as e:
        return e.code


def test_cli_classify_ray_equals_single_process_and_resumes(cluster, model_path, tmp_path):
    texts = _sentences(30)
    texts[7] = "   "
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps({"id": f"s{i}", "text": t}) + "\n" for i, t in enumerate(texts)))
    common = ["--model", model_path, "--labels", ",".join(LABELS), "--prefix", PREFIX, "-q", inp]
    assert _classify_cli([*common, "-o", tmp_path / "single.jsonl"]) == 0
    single = {r["id"]: r for r in map(json.loads, (tmp_path / "single.jsonl").read_text().splitlines())}

    out = tmp_path / "ray.jsonl"
    assert _classify_cli([*common, "--ray", "--actors", "2", "--batch-size", "8", "-o", out]) == 0
    lines = out.read_text().splitlines()
    _same(single, lines)

    # an interrupted run: 10 lines written and the 11th cut short; the re-run does only the rest
    out.write_text("\n".join(lines[:10]) + "\n" + lines[10][:12])
    assert _classify_cli([*common, "--ray", "--actors", "2", "-o", out]) == 0
    again = out.read_text().splitlines()
    assert again[:10] == lines[:10]
    _same(single, again)


def test_cli_bad_label_is_a_usage_error_from_the_actors(cluster, model_path, tmp_path, capsys):
    inp = tmp_path / "in.jsonl"
    inp.write_text(json.dumps({"id": 1, "text": "a b c"}) + "\n")
    rc = _classify_cli(["--ray", "--model", model_path, "--labels", "yes,,no", inp, "-o", tmp_path / "out.jsonl"])
    err = capsys.readouterr().err
    assert rc == 2 and "the actors could not start" in err and "label ''" in err, err
    assert not (tmp_path / "out.jsonl").read_text()  # nothing written, nothing to skip on a re-run


def test_cli_malformed_input_is_a_usage_error(cluster, model_path, tmp_path, capsys):
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"id": 1, "text": "a b"}\n{"id": 2, "text": \n')
    rc = _classify_cli(["--ray", "--model", model_path, "--labels", "yes,no", inp, "-o", tmp_path / "out.jsonl"])
    err = capsys.readouterr().err
    assert rc == 2 and f"cannot read {str(inp)!r}: ValueError" in err, err


def test_cli_other_input_columns_do_not_reach_the_output(cluster, model_path, tmp_path):
    """A gold `label` column in INPUT neither collides with the added `label` nor leaks into OUT."""
    inp = tmp_path / "gold.jsonl"
    inp.write_text("".join(json.dumps({"id": i, "sentence": s, "label": "gold"}) + "\n"
                           for i, s in enumerate(_sentences(4))))
    out = tmp_path / "out.jsonl"
    assert _classify_cli(["--ray", "-q", "--column", "sentence", "--model", model_path, "--labels", "yes,no",
                          inp, "-o", out]) == 0
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert sorted(r["id"] for r in rows) == [0, 1, 2, 3]
    assert all(set(r) == {"id", "label", "scores", "run"} and r["label"] in ("yes", "no") for r in rows)


def test_cli_generate_ray_jsonl_names_the_input_prompt(cluster, model_path, model, tmp_path):
    prompts = _sentences(6)
    inp = tmp_path / "q.jsonl"
    inp.write_text("".join(json.dumps({"id": f"q{i}", "question": p}) + "\n" for i, p in enumerate(prompts)))
    out = tmp_path / "out.jsonl"
    assert main(["generate", "--ray", "--actors", "2", "--column", "question", "--max-tokens", "4", "--slots", "2",
                 "--model", model_path, str(inp), "--output", str(out)]) == 0
    rows = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    for i, w in enumerate(model.batch_generate(prompts, max_tokens=4)):
        assert rows[f"q{i}"] == {"id": f"q{i}", "prompt": prompts[i], "text": w.text,
                                 "finish_reason": w.finish_reason, "tokens": w.tokens}


def _same(single: dict, lines: list[str]):
    rows = [json.loads(x) for x in lines]
    assert sorted(r["id"] for r in rows) == sorted(single)  # every id once
    for r in rows:
        s = single[r["id"]]
        if "error" in s:
            assert "empty" in s["error"] and "empty" in r["error"]
        else:
            assert r["label"] == s["label"] and r["scores"] == pytest.approx(s["scores"], abs=1e-4)


def test_cli_generate_ray_local_cluster_parquet_and_resume(model_path, tmp_path):
    """The whole command in its own process: it starts (and stops) its own local cluster."""
    prompts = _sentences(9)
    inp = tmp_path / "prompts.txt"  # no ids: rows are numbered from 1
    inp.write_text("\n".join(prompts) + "\n")
    out = tmp_path / "out.parquet"
    cmd = [sys.executable, "-m", "slotinfer", "generate", "--ray", "--actors", "2", "--model", model_path,
           "--max-tokens", "5", "--slots", "4", str(inp), "--output", str(out)]
    env = {**os.environ, "RAY_ADDRESS": ""}
    for _ in range(2):  # the second run finds every id done and adds no rows
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
        assert proc.returncode == 0, proc.stderr[-3000:]
    assert "0 rows, 0 errors, 9 already done" in proc.stderr
    rows = sorted(pq.read_table(out).to_pylist(), key=lambda r: r["id"])
    assert [r["id"] for r in rows] == list(range(1, 10))
    want = slotinfer.load(model_path).batch_generate(prompts, max_tokens=5)
    for r, p, w in zip(rows, prompts, want):
        assert (r["prompt"], r["tokens"], r["text"], r["error"]) == (p, w.tokens, w.text, None)


def test_numbering_the_rows_of_an_input_warns_of_nothing(cluster):
    """Rows without ids are numbered from 1 with no deprecation notice from Ray on every run."""
    import warnings

    from slotinfer.cli.ray_jobs import _with_ids

    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        ds, total = _with_ids(ray.data.from_items([{"text": t} for t in "abc"]))
    ours = [w for w in said if issubclass(w.category, DeprecationWarning) and "slotinfer" in w.filename]
    assert not ours, [str(w.message) for w in ours]  # Ray's own internals may still warn of theirs
    assert total == 3 and sorted((r["id"], r["text"]) for r in ds.take_all()) == [(1, "a"), (2, "b"), (3, "c")]


def test_rows_are_numbered_in_the_inputs_order_on_every_run_without_zip(cluster, tmp_path, monkeypatch):
    """A folder of files is numbered in file and line order, the same on every run (a resume depends on
    it), and without ``Dataset.zip``, which Ray 2.64 removes."""
    from slotinfer.cli.ray_jobs import _read, _with_ids

    monkeypatch.delattr(ray.data.Dataset, "zip")  # as in Ray >= 2.64
    folder, want = tmp_path / "rows.jsonl", []
    folder.mkdir()
    for f, n in enumerate([70, 5, 130, 1, 40]):
        lines = [f"file {f} line {i}" for i in range(n)]
        (folder / f"part-{f}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in lines))
        want += lines
    runs = []
    for _ in range(2):
        ds, total = _with_ids(_read(str(folder)))
        runs.append(sorted((r["id"], r["text"]) for r in ds.take_all()))
        assert total == len(want)
    assert runs[0] == runs[1] == list(enumerate(want, start=1))


def test_a_folder_named_slotinfer_ahead_of_the_package_is_named_in_one_line(tmp_path):
    """From the folder above a checkout, ``import slotinfer`` finds the checkout's root (a folder without
    __init__.py) as a namespace package while the submodules still load: Ray actors then failed with
    "module 'slotinfer' has no attribute 'load'". slotinfer.ray (in the driver and in every actor) and the
    command line say what happened instead."""
    shadow = tmp_path / "slotinfer"
    shadow.mkdir()
    for entry in Path(slotinfer.__file__).parent.iterdir():  # the package's modules, in a folder without __init__
        if entry.name not in ("__init__.py", "__pycache__"):
            (shadow / entry.name).symlink_to(entry)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the current folder first, as for a user
    run = lambda *args: subprocess.run([sys.executable, *args], cwd=tmp_path, env=env, capture_output=True,  # noqa
                                       text=True, timeout=300)
    probe = run("-c", "import slotinfer; print(slotinfer.__file__)")
    if probe.stdout.strip() != "None":
        pytest.skip("slotinfer is installed where the path finder sees it first: no namespace package here")
    for args in (["-c", "import slotinfer.ray"], ["-m", "slotinfer", "info"]):
        proc = run(*args)
        line = f"'import slotinfer' found the folder {str(shadow)!r} (no __init__.py"
        assert proc.returncode != 0 and line in proc.stderr.strip().splitlines()[-1], proc.stderr[-2000:]
        assert "has no attribute" not in proc.stderr and "run from another folder" in proc.stderr
