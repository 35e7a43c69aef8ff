"""The tokenization rule, written once: a shared context is read with the tokenizer's special
tokens (BOS where the family adds one); an appended span (question, new turn, continuation) is
read without them, as the continuation of what is already in the cache."""

from __future__ import annotations

import torch

from ctxrelay.models.spec import LoadedModel


def tokenize_context(m: LoadedModel, text: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids of a context (special tokens included) and each token's character span [T, 2].

    Added special tokens (BOS) get the empty span (0, 0).
    """
    enc = m.tokenizer(text, return_offsets_mapping=True, add_special_tokens=True)
    ids = torch.tensor(enc["input_ids"], dtype=torch.long)
    offsets = torch.tensor(enc["offset_mapping"], dtype=torch.long).view(-1, 2)
    return ids, offsets


def context_ids(m: LoadedModel, text: str) -> torch.Tensor:
    return torch.tensor(m.tokenizer(text, add_special_tokens=True)["input_ids"], dtype=torch.long)


def suffix_ids(m: LoadedModel, text: str) -> torch.Tensor:
    """Ids of a span appended after a context: no BOS/EOS inside it."""
    return torch.tensor(m.tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long)
