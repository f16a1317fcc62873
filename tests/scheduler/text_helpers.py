"""Helpers of the text-level tests: a tiny byte-level BPE tokenizer with a chat template, tiny Llama and Qwen dirs."""

from __future__ import annotations

from pathlib import Path

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Qwen3's switch: enable_thinking=False writes an empty thinking block after the assistant's header
QWEN3_CHAT_TEMPLATE = CHAT_TEMPLATE.replace(
    "<|im_start|>assistant\n{% endif %}",
    "<|im_start|>assistant\n{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
    "{% endif %}{% endif %}",
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "the quick brown fox jumps over the lazy dog", "hello world, hello there", "a library opens at nine",
    "what is the capital of france? paris is.", "numbers: 1 2 3 4 5 6 7 8 9 10", "stop here. and there.",
    "héllo wörld", "naïve café",
]  # fmt: skip


def tiny_tokenizer():
    """A byte-level BPE tokenizer (about 300 ids) trained on a few lines; rare characters split into bytes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS * 4, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", bos_token="<|endoftext|>", pad_token="<|endoftext|>",
        clean_up_tokenization_spaces=False,
    )  # fmt: skip
    fast.chat_template = CHAT_TEMPLATE
    return fast


def save_tiny_model(folder: Path, initializer_range: float = 0.2) -> Path:
    """Write a seeded random 2-layer Llama (safetensors) and the tiny tokenizer into ``folder`` (small weights, e.g.
    ``initializer_range=0.02``: greedy outputs that fall into loops)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = tiny_tokenizer()
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, initializer_range=initializer_range,
        eos_token_id=tokenizer.eos_token_id, bos_token_id=None, pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    LlamaForCausalLM(cfg).eval().save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def save_tiny_qwen(folder: Path, kind: str, **overrides) -> Path:
    """Write a seeded random 2-layer Qwen2 or Qwen3 (``sched_helpers.tiny_qwen``, safetensors) and the tiny
    tokenizer with a Qwen3-style ChatML template into ``folder``."""
    from sched_helpers import tiny_qwen

    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = QWEN3_CHAT_TEMPLATE
    ids = dict(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    tiny_qwen(kind, vocab_size=len(tokenizer), **ids, **overrides).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def save_tiny_qwen_gguf(path: Path, kind: str, **overrides):
    """Write ``sched_helpers.tiny_qwen(kind)`` over the tiny tokenizer as a float32 GGUF file at ``path`` (llama.cpp's
    tensor names, as gguf-py maps them, and its hyperparameter and byte-level BPE tokenizer keys); returns the
    transformers model it was written from."""
    import json

    import gguf
    from sched_helpers import tiny_qwen
    from transformers.modeling_gguf_pytorch_utils import TensorProcessor, get_gguf_hf_weights_map

    tokenizer = tiny_tokenizer()
    hf = tiny_qwen(kind, vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id, **overrides)
    c, w = hf.config, gguf.GGUFWriter(str(path), kind)
    w.add_block_count(c.num_hidden_layers), w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size), w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads), w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(10000.0), w.add_layer_norm_rms_eps(c.rms_norm_eps)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    w.add_key_length(head_dim), w.add_value_length(head_dim)  # llama.cpp's keys; transformers reads no qwen3 one
    model = json.loads(tokenizer.backend_tokenizer.to_str())["model"]
    tokens = sorted(tokenizer.get_vocab(), key=tokenizer.get_vocab().get)
    w.add_tokenizer_model("gpt2"), w.add_tokenizer_pre("qwen2"), w.add_token_list(tokens)
    w.add_token_types([3 if t in SPECIALS else 1 for t in tokens])  # 3: control tokens
    w.add_token_merges([" ".join(m) for m in model["merges"]]), w.add_eos_token_id(tokenizer.eos_token_id)
    w.add_chat_template(QWEN3_CHAT_TEMPLATE)
    gguf_names = {hf_name: name for name, hf_name in get_gguf_hf_weights_map(hf, TensorProcessor()).items()}
    for key, t in hf.state_dict().items():
        w.add_tensor(gguf_names[key], t.numpy())
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    return hf


def first_text_token(tokenizer, tokens: list[int]) -> int:
    """The position (after the first) of the first token with letters of its own text, seen nowhere before it."""
    texts = [tokenizer.decode([t]) for t in tokens]
    return next(i for i in range(1, len(tokens)) if texts[i].isalpha() and tokens[i] not in tokens[:i])
