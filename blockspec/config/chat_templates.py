"""The chat templates blockspec ships (`--chat-template NAME`, in assets/chat_templates/): templates that render
OpenAI `tools` for the model families blockspec serves, for checkpoints whose own template does not (SmolLM2's ChatML)
or renders a format no `--tool-call-parser` reads. `--chat-template FILE` takes any Jinja file instead."""
from __future__ import annotations

from pathlib import Path

TEMPLATE_DIR = Path(__file__).resolve().parents[1] / "assets" / "chat_templates"
# NOTE: name -> the --tool-call-parser that reads the calls the template asks for
CHAT_TEMPLATES = {"chatml": "qwen3", "llama3": "llama3"}


def chat_template_text(name_or_file: str) -> str:
    """The Jinja text of a shipped template (by name) or of a file; ValueError naming both choices otherwise."""
    if name_or_file in CHAT_TEMPLATES:
        return (TEMPLATE_DIR / f"{name_or_file}.jinja").read_text()
    path = Path(name_or_file).expanduser()
    if path.is_file():
        return path.read_text()
    raise ValueError(f"chat_template {name_or_file!r} is neither a shipped template ({', '.join(CHAT_TEMPLATES)}) "
                     "nor a file")
