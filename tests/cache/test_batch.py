"""StepBatch.build's row indices: the rows a mixed step's layers gather and scatter."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from deltaserve.cache.batch import SeqChunk, StepBatch

KV = SimpleNamespace(block_len=16)


def _table(n: int) -> tuple[int, ...]:
    return tuple(range(n))


def test_a_mixed_step_carries_its_row_lists_as_index_tensors() -> None:
    """Decode rows, attention's decode-style rows and logit rows of a step with a prefill chunk
    (and a verify chunk) are tensors built once, equal to the lists they stand for."""
    chunks = [SeqChunk(0, 5, 1, _table(1)), SeqChunk(1, 0, 20, _table(2)),
              SeqChunk(2, 7, 3, _table(1), verify=True), SeqChunk(3, 40, 1, _table(3))]
    batch = StepBatch.build(chunks, None, KV, "cpu")
    assert batch.offsets == [0, 1, 21, 24]
    assert batch.decode_rows().tolist() == [0, 24]
    assert batch.attend_rows().tolist() == [0, 21, 22, 23, 24]  # decodes and every verify row
    assert batch.logit_index().tolist() == batch.logit_rows() == [0, 20, 21, 22, 23, 24]
    assert all(t.dtype == torch.int64 for t in batch.row_index.values())


def test_steps_without_prefill_chunks_index_by_slices() -> None:
    """All-decode steps (what CUDA graphs capture) build no index tensor; a verify step without
    prefill attends every row, so only its decode and logit rows are tensors."""
    decodes = StepBatch.build([SeqChunk(0, 5, 1, _table(1)), SeqChunk(1, 9, 1, _table(1))],
                              None, KV, "cpu")
    assert decodes.decode_rows() == slice(None) and decodes.attend_rows() == slice(None)
    assert decodes.logit_index() is None and not decodes.row_index
    verify = StepBatch.build([SeqChunk(0, 5, 1, _table(1)),
                              SeqChunk(1, 9, 4, _table(1), verify=True)], None, KV, "cpu")
    assert verify.decode_rows().tolist() == [0]
    assert verify.attend_rows() == slice(None)
    assert verify.logit_index().tolist() == [0, 1, 2, 3, 4]
