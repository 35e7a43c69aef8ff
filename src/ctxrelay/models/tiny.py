"""Tiny random-initialised models of the real architectures, for fast tests and smoke runs.

Each tiny model gets a small tokenizer trained here (seconds) in the style of its family
(byte-level BPE for llama/qwen2, metaspace BPE with <bos> for gemma3), so tokenisations really
differ between families, as they do between the real models.
"""

from __future__ import annotations

import functools

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from ctxrelay.models.spec import LoadedModel, wrap

_CORPUS = [
    "The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.",
    "How vexingly quick daft zebras jump! Sphinx of black quartz, judge my vow.",
    "def forward(self, x):\n    return self.proj(x) + 1  # residual\n",
    "In 2024, 3.14159 people paid $1,234.56 for 42 items -- a 7% increase over 2023.",
    "Startups are companies designed to grow fast. Being newly founded does not in itself make a "
    "company a startup. Nor is it necessary for a startup to work on technology.",
    "Café naïve résumé façade jalapeño; 東京は日本の首都です。 Emoji: 🙂🚀✨.",
    "    indented\ttabs\t\tand   runs   of    spaces\n\n\nnew lines",
    "The best way to get startup ideas is not to try to think of startup ideas. It's to look for "
    "problems, preferably problems you have yourself.",
]


@functools.cache
def tiny_tokenizer(style: str) -> PreTrainedTokenizerFast:
    """style 'bytelevel' (llama/qwen-like, no BOS) or 'metaspace' (gemma-like, adds <bos>)."""
    specials = ["<pad>", "<eos>", "<bos>", "<unk>"]
    if style == "bytelevel":
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
        trainer = trainers.BpeTrainer(vocab_size=420, special_tokens=specials, initial_alphabet=alphabet)
        tok.train_from_iterator(_CORPUS * 4, trainer)
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    elif style == "metaspace":
        tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
        tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
        tok.decoder = decoders.Sequence([decoders.Metaspace(prepend_scheme="first"), decoders.ByteFallback()])
        byte_tokens = [f"<0x{i:02X}>" for i in range(256)]
        trainer = trainers.BpeTrainer(vocab_size=360, special_tokens=specials + byte_tokens)
        tok.train_from_iterator(_CORPUS * 4, trainer)
        bos = tok.token_to_id("<bos>")
        tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", bos)])
    else:
        raise ValueError(f"unknown tokenizer style {style!r} (use 'bytelevel' or 'metaspace')")
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>", unk_token="<unk>"
    )


def _common(tok: PreTrainedTokenizerFast) -> dict:
    return dict(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=4096,
        initializer_range=0.1,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )


def tiny_model(family: str, *, layers: int = 4, seed: int = 0, sliding_window: int = 8) -> LoadedModel:
    """A random-initialised model of `family` ('llama', 'qwen2' or 'gemma3'), fp32, on CPU."""
    torch.manual_seed(seed)
    if family == "llama":
        tok = tiny_tokenizer("bytelevel")
        hf = LlamaForCausalLM(LlamaConfig(num_hidden_layers=layers, tie_word_embeddings=True, **_common(tok)))
    elif family == "qwen2":
        tok = tiny_tokenizer("bytelevel")
        cfg = Qwen2Config(num_hidden_layers=layers, tie_word_embeddings=False, **_common(tok))
        hf = Qwen2ForCausalLM(cfg)
        with torch.no_grad():  # qwen2 has q/k/v biases; make them non-zero so tests see them
            for layer in hf.model.layers:
                for p in (
                    layer.self_attn.q_proj.bias,
                    layer.self_attn.k_proj.bias,
                    layer.self_attn.v_proj.bias,
                ):
                    p.normal_(0, 0.1)
    elif family == "gemma3":
        tok = tiny_tokenizer("metaspace")
        pattern = ["sliding_attention"] * (layers - 1) + ["full_attention"]
        cfg = Gemma3TextConfig(
            num_hidden_layers=layers,
            sliding_window=sliding_window,
            layer_types=pattern,
            query_pre_attn_scalar=16,
            tie_word_embeddings=True,
            **_common(tok),
        )
        hf = Gemma3ForCausalLM(cfg)
        with torch.no_grad():  # Gemma norms are (1 + w) with w=0 at init; perturb so they matter
            for name, p in hf.named_parameters():
                if "norm" in name:
                    p.normal_(0, 0.2)
    else:
        raise ValueError(f"unknown family {family!r} (use 'llama', 'qwen2' or 'gemma3')")
    hf = hf.float().eval()
    return wrap(hf, tok, f"tiny-{family}-L{layers}-s{seed}")
