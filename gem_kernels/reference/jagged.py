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


def hstu_sequence_layout(history_offsets: torch.Tensor, num_candidates: torch.Tensor,
                         request_timestamps: torch.Tensor, history_timestamps: torch.Tensor, contextual_len: int,
                         num_rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """gem_kernels.ops.jagged.hstu_sequence_layout in plain PyTorch (any device, any integer dtypes)."""
    device = history_offsets.device
    num_users, c = num_candidates.shape[0], contextual_len
    history_lengths = history_offsets.diff()
    num_history = history_timestamps.shape[0]
    users = torch.arange(num_users, device=device)
    lengths = c + history_lengths + num_candidates
    seq_offsets = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)])
    starts = seq_offsets[:-1]
    context_rows = (starts.unsqueeze(1) + torch.arange(c, device=device)).reshape(-1)
    # Item i of a user's history (candidates) goes to row i + (that user's first row of it - its index in
    # the batch's history (candidates)): one per-user shift, gathered per item.
    history_owner = torch.repeat_interleave(users, history_lengths, output_size=num_history)
    history_shift = starts + c - history_offsets[:-1]
    history_rows = torch.arange(num_history, device=device) + history_shift.index_select(0, history_owner)
    candidate_owner = torch.repeat_interleave(users, num_candidates, output_size=num_rows)
    candidate_shift = seq_offsets[1:] - num_candidates.cumsum(0)
    candidate_rows = torch.arange(num_rows, device=device) + candidate_shift.index_select(0, candidate_owner)
    rows = torch.cat([context_rows, history_rows, candidate_rows])
    request = request_timestamps
    timestamps = torch.cat([request.repeat_interleave(c, output_size=num_users * c), history_timestamps,
                            request[candidate_owner]])
    timestamps = torch.empty_like(timestamps).index_copy_(0, rows, timestamps)
    # The next item within the user's own history, the request's for its last item: read from the
    # history itself, not from the next row, which is another user's when the user has no candidate.
    following = torch.empty_like(history_timestamps)
    following[:-1] = history_timestamps[1:]
    last = (history_offsets[1:][history_lengths > 0] - 1).long()
    following.index_copy_(0, last, request[history_lengths > 0].to(following.dtype))
    query_timestamps = timestamps.index_copy(0, history_rows, following.to(timestamps.dtype))
    return seq_offsets, rows, candidate_owner, timestamps, query_timestamps


def jagged_broadcast_cat(dense: torch.Tensor, offsets: torch.Tensor, jagged: torch.Tensor) -> torch.Tensor:
    """out[n] = cat(dense[b], jagged[n]) for n in offsets[b] : offsets[b+1]: [N, K + S]."""
    seq_ids, _ = _row_positions(offsets, jagged.shape[0])
    return torch.cat([dense.index_select(0, seq_ids), jagged], dim=1)


def jagged_broadcast_cat_backward(grad: torch.Tensor, offsets: torch.Tensor,
                                  dense_width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """grad [N, K + S] -> (grad_dense [B, K]: each sequence's rows of grad[:, :K] summed in fp32 (fp64 for
    fp64), grad_jagged [N, S] = grad[:, K:])."""
    seq_ids, _ = _row_positions(offsets, grad.shape[0])
    acc = torch.float64 if grad.dtype == torch.float64 else torch.float32
    grad_dense = grad.new_zeros((offsets.numel() - 1, dense_width), dtype=acc)
    grad_dense.index_add_(0, seq_ids, grad[:, :dense_width].to(acc))
    return grad_dense.to(grad.dtype), grad[:, dense_width:].contiguous()
