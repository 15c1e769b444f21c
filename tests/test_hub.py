"""Hub ids in ``load``: resolved by the real huggingface_hub from a real cache layout, offline.

Each test writes a Hugging Face cache as huggingface_hub itself lays one out
(``hub/models--org--name/blobs/<hash>``, ``snapshots/<commit>/<file>`` linked to the blobs,
``refs/<branch>``, ``trees/<commit>.json``), points ``HF_HOME`` at it with
``HF_HUB_OFFLINE=1``, and loads in a fresh interpreter: huggingface_hub reads both variables
once, at import, as it does for a user who sets them in the shell.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

import slotinfer
from slotinfer import default_model
from slotinfer.errors import InvalidRequestError, ModelNotFoundError
from slotinfer.hub import split_id
from slotinfer.testing import make_tiny_model

PROMPTS = ["Hello there", "The capital of France is", "1, 2, 3,"]
REPO = "tiny-org/qwen3-tiny"
MAIN, OLD = "a" * 40, "b" * 40  # commit hashes: main and an older tagged release
NOT_FETCHED = {"README.md": b"# a model card\n", "onnx/model.onnx": b"\0" * 64}  # listed on the hub only


def write_cache(home: Path, repo_id: str, commit: str, folder: Path | None = None, *, files=None,
                refs=("main",), listed=NOT_FETCHED) -> Path:
    """Put ``folder``'s files (or ``files``: name -> bytes) in the cache under ``home`` as one commit
    of ``repo_id``; ``listed``: files the repo's listing names that were not downloaded."""
    storage = home / "hub" / ("models--" + repo_id.replace("/", "--"))
    files = dict(files or {})
    if folder is not None:
        files |= {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}
    tree = {}
    for name, data in files.items():
        lfs = name.endswith((".safetensors", ".gguf"))  # large files: the blob is named by its sha256
        blob = _git_blob_id(data)
        blob_name = hashlib.sha256(data).hexdigest() if lfs else blob
        (storage / "blobs").mkdir(parents=True, exist_ok=True)
        (storage / "blobs" / blob_name).write_bytes(data)
        link = storage / "snapshots" / commit / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(storage / "blobs" / blob_name, link.parent))
        tree[name] = {"size": len(data), "blob_id": blob}
        if lfs:
            tree[name] |= {"lfs_sha256": blob_name, "lfs_size": len(data)}
    for name, data in listed.items():
        tree[name] = {"size": len(data), "blob_id": _git_blob_id(data)}
    (storage / "trees").mkdir(exist_ok=True)
    (storage / "trees" / f"{commit}.json").write_text(json.dumps({"format_version": 1, "files": tree}))
    for ref in refs:
        (storage / "refs").mkdir(exist_ok=True)
        (storage / "refs" / ref).write_text(commit)  # no newline, as huggingface_hub writes it
    return storage / "snapshots" / commit


def _git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def offline(home: Path, code: str, *args) -> dict:
    """Run ``code`` in a fresh interpreter with the cache at ``home`` and the hub off; its JSON output."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_"))}
    env |= {"HF_HOME": str(home), "HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1"}
    proc = subprocess.run([sys.executable, "-c", code, *map(str, args)], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


LOAD = """
import json, sys, slotinfer
spec, revision = sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else None)
try:
    m = slotinfer.load(spec, revision=revision)
except Exception as e:
    print(json.dumps({"error": type(e).__name__, "message": str(e)}))
else:
    out = [m.generate(p, max_tokens=6).tokens for p in %r]
    batch = [r.tokens for r in m.batch_generate(%r, max_tokens=6)]
    print(json.dumps({"path": str(m.path), "tokens": out, "batch": batch}))
""" % (PROMPTS, PROMPTS)


def greedy(folder) -> list[list[int]]:
    m = slotinfer.load(folder)
    return [m.generate(p, max_tokens=6).tokens for p in PROMPTS]


@pytest.mark.parametrize("layout", [{}, {"shards": 3}], ids=["one-file", "sharded"])
def test_an_id_loads_its_cached_snapshot_and_generates_as_its_folder(tmp_path, layout):
    folder = make_tiny_model("qwen3", tmp_path / "model", **layout)
    snapshot = write_cache(tmp_path / "hf", REPO, MAIN, folder)
    got = offline(tmp_path / "hf", LOAD, REPO)
    assert "error" not in got, got
    assert Path(got["path"]) == snapshot  # the cache's snapshot, not a copy elsewhere
    expected = greedy(folder)
    assert got["tokens"] == expected and got["batch"] == expected


def test_revision_pins_a_commit_or_tag(tmp_path):
    new = make_tiny_model("qwen3", tmp_path / "new", seed=1)
    old = make_tiny_model("qwen3", tmp_path / "old", seed=2)
    home = tmp_path / "hf"
    write_cache(home, REPO, MAIN, new)
    write_cache(home, REPO, OLD, old, refs=("v1.0",))
    new_tokens, old_tokens = greedy(new), greedy(old)
    assert new_tokens != old_tokens  # else the test could not tell the revisions apart
    assert offline(home, LOAD, REPO)["tokens"] == new_tokens
    assert offline(home, LOAD, REPO, "main")["tokens"] == new_tokens
    assert offline(home, LOAD, REPO, "v1.0")["tokens"] == old_tokens
    assert offline(home, LOAD, REPO, OLD)["tokens"] == old_tokens
    missing = offline(home, LOAD, REPO, "v2.0")
    assert missing["error"] == "ModelNotFoundError" and "'v2.0'" in missing["message"]


def test_an_uncached_id_is_a_typed_error_that_says_how_to_get_it(tmp_path):
    write_cache(tmp_path / "hf", REPO, MAIN, files={"config.json": b"{}"})  # another repo is cached
    got = offline(tmp_path / "hf", LOAD, "some-org/not-downloaded")
    assert got["error"] == "ModelNotFoundError"
    msg = got["message"]
    assert "'some-org/not-downloaded'" in msg and "could not be reached" in msg and "HF_HUB_OFFLINE" in msg
    assert "hf download some-org/not-downloaded" in msg  # how to get the files
    # first that no local path has that name (a mistyped relative folder reads as an id), then the hub's part
    assert msg.startswith("'some-org/not-downloaded' names no local file or folder (there is no 'some-org' in "), msg
    assert msg.index("the current folder") < msg.index("Hugging Face"), msg


def test_the_cli_takes_an_id(tmp_path):
    folder = make_tiny_model("qwen3", tmp_path / "model")
    write_cache(tmp_path / "hf", REPO, MAIN, folder)
    got = offline(tmp_path / "hf", """
import json, subprocess, sys
run = lambda *a: subprocess.run([sys.executable, "-m", "slotinfer", "generate", "--max-tokens", "5", *a],
                                capture_output=True, text=True)
ok = run("--model", sys.argv[1], "--output", sys.argv[2], "Hello there")
missing = run("--model", "some-org/absent", "Hello there")
print(json.dumps({"rc": [ok.returncode, missing.returncode], "out": open(sys.argv[2]).read(), "err": missing.stderr}))
""", REPO, str(tmp_path / "out.jsonl"))
    assert got["rc"] == [0, 2]
    text = json.loads(got["out"])["text"]  # one prompt streams its text to stdout; --output holds its record
    assert text == slotinfer.load(folder).generate("Hello there", max_tokens=5).text
    assert got["err"].startswith("slotinfer: error: 'some-org/absent'") and "Traceback" not in got["err"]


GGUF_REPO = "tiny-org/tiny-gguf"
RESOLVE = """
import json, sys
from slotinfer import hub
try:
    print(json.dumps({"path": str(hub.local_path(sys.argv[1]))}))
except Exception as e:
    print(json.dumps({"error": type(e).__name__, "message": str(e)}))
"""


def test_a_named_gguf_file_resolves_to_its_cached_file(tmp_path):
    files = {"tiny-Q8_0.gguf": b"GGUF q8", "tiny-Q4_0.gguf": b"GGUF q4", "README.md": b"card"}
    snapshot = write_cache(tmp_path / "hf", GGUF_REPO, MAIN, files=files, listed={})
    home = tmp_path / "hf"
    got = offline(home, RESOLVE, f"{GGUF_REPO}:tiny-Q4_0.gguf")
    assert Path(got["path"]) == snapshot / "tiny-Q4_0.gguf" and Path(got["path"]).read_bytes() == b"GGUF q4"
    several = offline(home, RESOLVE, GGUF_REPO)  # which of the two? the error says how to pick
    assert several["error"] == "ModelNotFoundError"
    assert f"'{GGUF_REPO}:tiny-Q4_0.gguf'" in several["message"] and "tiny-Q8_0.gguf" in several["message"]
    absent = offline(home, RESOLVE, f"{GGUF_REPO}:tiny-Q2_K.gguf")
    assert absent["error"] == "ModelNotFoundError" and "could not be reached" in absent["message"]
    not_gguf = offline(home, RESOLVE, f"{GGUF_REPO}:README.md")
    assert not_gguf["error"] == "InvalidRequestError" and "a .gguf" in not_gguf["message"]


@pytest.mark.parametrize("name", ["only-Q8_0.gguf", "q8/only-Q8_0.gguf"])
def test_a_repo_with_one_gguf_resolves_to_that_file(tmp_path, name):
    snapshot = write_cache(tmp_path / "hf", GGUF_REPO, MAIN, files={name: b"GGUF", "README.md": b"card"})
    assert Path(offline(tmp_path / "hf", RESOLVE, GGUF_REPO)["path"]) == snapshot / name


def test_a_repo_without_weights_slotinfer_reads_is_refused_by_name(tmp_path):
    write_cache(tmp_path / "hf", REPO, MAIN, files={"config.json": b"{}", "pytorch_model.bin": b"torch"})
    got = offline(tmp_path / "hf", RESOLVE, REPO)
    assert got["error"] == "ModelNotFoundError"
    assert got["message"].startswith(f"{REPO} holds neither config.json with *.safetensors weights nor a .gguf")


@pytest.mark.parametrize("spec", ["./no-such/model", "/no/such/model", "no-such/model/", "a/b/c", "~/no-such-model",
                                  "no-such-model", "../no-such/model", Path("no-such-org/model")])
def test_a_path_that_does_not_exist_is_a_folder_error_not_a_hub_error(spec):
    with pytest.raises(ModelNotFoundError, match="does not exist") as e:
        slotinfer.load(spec)
    assert "hub" not in str(e.value).lower()


def test_revision_is_refused_for_a_local_folder(model_dir):
    with pytest.raises(InvalidRequestError, match="revision='main' applies to Hugging Face repo ids"):
        slotinfer.load(model_dir("qwen3"), revision="main")


name_st = st.from_regex(r"[A-Za-z0-9_]([A-Za-z0-9_.-]{0,20}[A-Za-z0-9_])?", fullmatch=True).filter(
    lambda s: "--" not in s and ".." not in s)


@given(name_st, name_st, st.none() | st.from_regex(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,20}\.gguf", fullmatch=True))
def test_repo_ids_split_into_repo_and_file(org, name, file):
    text = f"{org}/{name}" + (f":{file}" if file else "")
    assert split_id(text) == (f"{org}/{name}", file)


@given(name_st, name_st, st.sampled_from(["./", "../", "/", "~/", "", ""]), st.sampled_from(["", "/", "/x", "\\x"]))
def test_paths_are_not_repo_ids(org, name, lead, tail):
    text = f"{lead}{org}/{name}{tail}"
    assert (split_id(text) is None) == bool(lead or tail)
    assert split_id(Path(f"{org}/{name}")) is None  # a Path is always a local path


@pytest.mark.skipif(default_model.path() is None or not any(Path(slotinfer.__file__).parent.glob("gguf*")),
                    reason=f"needs {default_model.NAME} ({default_model.INSTALL}) and GGUF loading")
def test_the_real_gguf_loads_from_an_id_as_from_its_file(tmp_path):
    gguf = default_model.path()
    repo = "tiny-org/smollm2-gguf"
    write_cache(tmp_path / "hf", repo, MAIN, files={gguf.name: gguf.read_bytes()})
    expected = greedy(gguf)
    for spec in (f"{repo}:{gguf.name}", repo):  # the named file, and the repo's one GGUF
        got = offline(tmp_path / "hf", LOAD, spec)
        assert "error" not in got, got
        assert got["tokens"] == expected and got["batch"] == expected


def test_a_mistyped_local_folder_is_a_missing_path_not_a_hub_id(tmp_path):
    """``models/x`` where ./models is a folder on this machine: the folder's entry is missing, and the
    error says so (with what the folder holds) instead of reporting a repo the hub does not have."""
    (tmp_path / "models" / "qwen3-tiny").mkdir(parents=True)
    got = offline(tmp_path / "hf", "import os, sys, slotinfer; os.chdir(sys.argv.pop(1))\n" + LOAD, tmp_path, "models/qwen3-tny")
    assert got["error"] == "ModelNotFoundError", got
    assert "'models/qwen3-tny' does not exist" in got["message"] and "qwen3-tiny" in got["message"], got
    assert "hub" not in got["message"].lower().replace("a hugging face repo id", ""), got
