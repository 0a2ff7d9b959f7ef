"""Reference jagged <-> padded conversions: vectorised plain PyTorch, any device, autograd-free.

Sequence b is values[offsets[b] : offsets[b+1]]; padded[b, p] = values[offsets[b] + p] for
p < min(L_b, max_len), else pad_value. The twin ops are each other's adjoint.
"""

import torch


def _row_positions(offsets: torch.Tensor, total_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For every jagged row: the sequence it belongs to and its position within that sequence."""
    offsets = offsets.long()
    lengths = offsets.diff()
    seq_ids = torch.repeat_interleave(torch.arange(lengths.numel(), device=offsets.device), lengths,
                                      output_size=total_len)
    positions = torch.arange(total_len, device=offsets.device) - offsets[seq_ids]
    return seq_ids, positions


def jagged_to_padded(values: torch.Tensor, offsets: torch.Tensor, max_len: int, pad_value: float) -> torch.Tensor:
    """values [N, D] -> padded [B, max_len, D]; sequences longer than max_len are truncated."""
    num_seqs = offsets.numel() - 1
    padded = values.new_full((num_seqs, max_len, values.shape[1]), pad_value)
    seq_ids, positions = _row_positions(offsets, values.shape[0])
    keep = positions < max_len
    padded[seq_ids[keep], positions[keep]] = values[keep]
    return padded


def padded_to_jagged(padded: torch.Tensor, offsets: torch.Tensor, total_len: int) -> torch.Tensor:
    """padded [B, max_len, D] -> values [total_len, D]; rows past max_len (truncated) are zero."""
    values = padded.new_zeros((total_len, padded.shape[2]))
    seq_ids, positions = _row_positions(offsets, total_len)
    keep = positions < padded.shape[1]
    values[keep] = padded[seq_ids[keep], positions[keep]]
    return values
