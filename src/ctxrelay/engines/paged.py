"""Block arithmetic of an engine's paged KV cache, shared by the connectors (no engine imported)."""

from __future__ import annotations

import torch

# vLLM's block pool hands its first block out as the null block: a sliding-window group's table holds it
# where the window has passed (nothing is stored there), and no request's real block has its id.
NULL_BLOCK = 0


def claimable(payload_tokens: int, prompt_tokens: int, block_size: int) -> int:
    """Prompt positions a K/V file of `payload_tokens` may fill: whole blocks, leaving the prompt's last token
    to the engine (it computes the logits of at least one)."""
    return max(0, min(payload_tokens, prompt_tokens - 1)) // block_size * block_size


def slot_mapping(block_ids: list[int], start: int, end: int, block_size: int) -> torch.Tensor:
    """Cache slots of positions start..end-1 of a request whose blocks are `block_ids`, in order."""
    pos = torch.arange(start, end, dtype=torch.long)
    blocks = torch.tensor(block_ids, dtype=torch.long)[pos // block_size]
    return blocks * block_size + pos % block_size
