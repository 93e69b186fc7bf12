"""Tiny random Hugging Face models the tests build for themselves (nothing can be downloaded here).

One shape for every test that needs a model other than the default GGUF: loaders, a second model beside the real
one, and the CUDA machines, where the real GGUF cannot travel.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

TINY_SHAPE: dict[str, int] = {
    "vocab_size": 96,
    "hidden_size": 64,
    "intermediate_size": 112,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
}

# SmolLM2's layer shapes (9 query and 3 KV heads of 64, MLP 1536, tied embeddings): a test picks the layers and the
# vocabulary. The kernels take the real model's paths at a fraction of its load.
SMOLLM2_LAYOUT: dict[str, int] = {
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "tie_word_embeddings": True,
}


def word_tokenizer(vocab_size: int) -> Any:
    """A word-level tokenizer of vocab_size tokens (<unk> 0, <s> 1, </s> 2, then w3, w4, ...): no model file needed."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, vocab_size)}}
    inner = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    inner.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=inner, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


class NoTokenizer:
    """For ``save_tiny_llama(tokenizer=NoTokenizer())``: a draft model's directory needs no tokenizer files (the
    target's tokenizer is the one used)."""

    def save_pretrained(self, directory: Any) -> None:
        pass


def save_tiny_llama(directory: str | Path, seed: int = 0, tokenizer: Any = None, **shape: int) -> str:
    """A random LlamaForCausalLM of TINY_SHAPE (updated by ``shape``) saved as safetensors into directory, with
    ``tokenizer`` (default: a word-level one of the model's vocabulary); returns the directory."""
    import transformers

    config = transformers.LlamaConfig(**{**TINY_SHAPE, **shape})
    torch.manual_seed(seed)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    (tokenizer if tokenizer is not None else word_tokenizer(config.vocab_size)).save_pretrained(directory)
    return str(directory)
