"""The two coding agents, Codex CLI (``/v1/responses``) and Claude Code (``/v1/messages``), each run a
one-shot task to the end against the real server with no protocol error (skipped where the CLI is
not installed: ``npm install -g @openai/codex @anthropic-ai/claude-code``).

The model is a tiny random one with a long context: its replies are gibberish, the point is the
protocol. The agents' default prompts are tens of thousands of this vocabulary's tokens (minutes of
prefill on a small CPU), so these runs give each a short system prompt; docs/serve.md has the runs
with their whole default prompts."""

import json
import os
import shutil
import subprocess

import pytest

import slotinfer
from slotinfer.serve import build_app
from slotinfer.serve.background import serving

pytestmark = pytest.mark.slow  # real agents (Codex, Claude Code) against the server

NAME = "tiny"


@pytest.fixture(scope="module")
def server(model_dir):
    model = slotinfer.load(model_dir("qwen3", overrides={"max_position_embeddings": 65536}))
    with slotinfer.Inferencer(model, slots=2, max_len=65536, max_queue=8) as inf:
        with serving(build_app(inf, served_model_name=NAME, api_key="sk-agent")) as url:
            yield url, inf


def _quiet_env(home):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "ANTHROPIC_", "CODEX_", "CLAUDE_"))}
    return {**env, "HOME": str(home), "DISABLE_TELEMETRY": "1", "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1"}


@pytest.mark.skipif(shutil.which("codex") is None, reason="Codex CLI is not installed (npm install -g @openai/codex)")
@pytest.mark.skipif(not os.environ.get("SLOTINFER_EXAMPLES"), reason="about 3 minutes of prefill: set SLOTINFER_EXAMPLES")
def test_codex_exec_runs_to_the_end_over_responses(server, tmp_path):
    url, _ = server
    home = tmp_path / "codex"
    home.mkdir()
    (home / "instructions.md").write_text("You are a coding agent. Answer briefly.\n")
    (home / "config.toml").write_text(
        f'model = "{NAME}"\nmodel_provider = "slotinfer"\nmodel_instructions_file = "{home / "instructions.md"}"\n'
        f'[model_providers.slotinfer]\nname = "slotinfer"\nbase_url = "{url}/v1"\nwire_api = "responses"\n'
        f'env_key = "SLOTINFER_KEY"\n')
    work = tmp_path / "work"
    work.mkdir()
    run = subprocess.run(["codex", "exec", "--skip-git-repo-check", "Say hello."], cwd=work, capture_output=True,
                         text=True, timeout=900, env={**_quiet_env(tmp_path), "CODEX_HOME": str(home),
                                                      "SLOTINFER_KEY": "sk-agent"})
    assert run.returncode == 0, run.stderr[-3000:]
    assert "ERROR" not in run.stderr and "tokens used" in run.stderr, run.stderr[-3000:]


@pytest.mark.skipif(shutil.which("claude") is None,
                    reason="Claude Code is not installed (npm install -g @anthropic-ai/claude-code)")
def test_claude_code_print_runs_to_the_end_over_messages(server, tmp_path):
    url, _ = server
    work = tmp_path / "work"
    work.mkdir()
    env = {**_quiet_env(tmp_path), "ANTHROPIC_BASE_URL": url, "ANTHROPIC_API_KEY": "sk-agent",
           "ANTHROPIC_MODEL": NAME, "ANTHROPIC_SMALL_FAST_MODEL": NAME, "ANTHROPIC_DEFAULT_HAIKU_MODEL": NAME,
           "CLAUDE_STREAM_IDLE_TIMEOUT_MS": "1800000", "API_TIMEOUT_MS": "1800000"}
    run = subprocess.run(["claude", "-p", "Say hello.", "--system-prompt", "You are a coding agent. Answer briefly.",
                          "--tools", "Bash", "--output-format", "json"], cwd=work, capture_output=True, text=True,
                         timeout=900, env=env)
    assert run.returncode == 0, (run.stdout[-3000:], run.stderr[-3000:])
    result = json.loads(run.stdout)
    assert result["type"] == "result" and not result["is_error"], result
    assert result["subtype"] == "success" and result["num_turns"] >= 1, result
