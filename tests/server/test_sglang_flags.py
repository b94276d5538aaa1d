"""SGLang `serve` flags a newcomer brings (issue 53, finding 2): each one works, or is refused with an error that says
what blockspec does instead; an unknown flag is reported with `serve`'s usage; --disable-piecewise-cuda-graph wins
over every reason to capture piecewise graphs."""
from __future__ import annotations

import pytest
import torch

from blockspec.cli import main
from blockspec.config.engine_config import EngineConfig
from blockspec.server.args import parse_serve_args

BASE = ["--model-path", "/m"]
CUDA = torch.device("cuda")
LLAMA = "LlamaForCausalLM"

def test_enable_piecewise_cuda_graph_is_accepted_with_a_note() -> None:
    args = parse_serve_args([*BASE, "--enable-piecewise-cuda-graph"])
    assert args.engine["enforce_piecewise_cuda_graph"] is True
    assert any("piecewise CUDA graphs" in note for note in args.notes)


def test_disable_piecewise_cuda_graph_turns_them_off() -> None:
    engine = parse_serve_args([*BASE, "--disable-piecewise-cuda-graph"]).engine
    config = EngineConfig.from_kwargs(**engine)
    assert config.disable_piecewise_cuda_graph is True
    assert not config.piecewise_graphs_on(CUDA, LLAMA)
    enforced = EngineConfig("/m", enforce_piecewise_cuda_graph=True)
    assert enforced.piecewise_graphs_on(CUDA, LLAMA) and not enforced.piecewise_graphs_on(torch.device("cpu"), LLAMA)


def test_piecewise_graphs_are_on_by_default_where_supported() -> None:
    """As SGLang: the default captures them on CUDA for Llama, Qwen3 and Qwen3-MoE targets (every family served);
    --disable-piecewise-cuda-graph and --disable-cuda-graph turn them off; a family the GPU suite has not run yet
    needs --enforce-piecewise-cuda-graph."""
    default = EngineConfig.from_kwargs(**parse_serve_args(BASE).engine)
    for family in (LLAMA, "Qwen3ForCausalLM", "Qwen3MoeForCausalLM"):
        assert default.piecewise_graphs_on(CUDA, family)
        assert not EngineConfig("/m", disable_piecewise_cuda_graph=True).piecewise_graphs_on(CUDA, family)
    assert not default.piecewise_graphs_on(torch.device("cpu"), LLAMA)
    assert not EngineConfig("/m", disable_cuda_graph=True).piecewise_graphs_on(CUDA, LLAMA)
    assert not default.piecewise_graphs_on(CUDA, "MistralForCausalLM")
    assert EngineConfig("/m", enforce_piecewise_cuda_graph=True).piecewise_graphs_on(CUDA, "MistralForCausalLM")


def test_working_flags() -> None:
    args = parse_serve_args([*BASE, "--chat-template", "chatml", "--dp-size", "1", "--schedule-policy", "fcfs",
                             "--log-requests"])
    assert args.engine["chat_template"] == "chatml" and args.server.log_level == "info"
    assert args.engine["log_level"] == "warning"  # NOTE: only the HTTP server's access log gets louder
    assert any("--tool-call-parser qwen3" in note for note in args.notes)
    assert not parse_serve_args([*BASE, "--chat-template", "llama3", "--tool-call-parser", "llama3"]).notes
    EngineConfig.from_kwargs(**args.engine)


@pytest.mark.parametrize("argv, message", [
    (["--reasoning-parser", "qwen3"], "--reasoning-parser: blockspec does not split a reply into reasoning_content"),
    (["--quantization", "fp8"], "--quantization: blockspec loads 16/32-bit safetensors weights"),
    (["--revision", "main"], "--revision: blockspec loads a hub id's default branch"),
    (["--download-dir", "/tmp/x"], "--download-dir: blockspec fetches hub ids into the Hugging Face cache"),
    (["--enable-torch-compile"], "--enable-torch-compile: blockspec runs decode, verify and the draft in full CUDA"),
    (["--watchdog-timeout", "300"], "--watchdog-timeout: blockspec has no forward watchdog"),
    (["--dp-size", "2"], "--dp-size 2: blockspec runs one engine per server"),
    (["--schedule-policy", "lpm"], "--schedule-policy lpm: blockspec admits waiting requests first come"),
    (["--chat-template", "nosuch"], "--chat-template 'nosuch' is neither a shipped template (chatml, llama3)"),
    (["--enable-piecewise-cuda-graph", "--disable-piecewise-cuda-graph"], "contradict each other"),
])
def test_refused_flags_say_what_blockspec_does(argv: list[str], message: str,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        parse_serve_args([*BASE, *argv])
    assert exited.value.code == 2 and message in capsys.readouterr().err


def test_unknown_flag_prints_serve_usage(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["serve", *BASE, "--no-such-flag"])
    err = capsys.readouterr().err
    assert exited.value.code == 2
    assert err.startswith("usage: blockspec serve") and "unrecognized arguments: --no-such-flag" in err
