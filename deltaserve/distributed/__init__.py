"""Tensor parallelism on torch.distributed: process groups (torchrun's or our own launcher's), the
shard plan of a checkpoint, the sharded model's reductions (exact or compressed), worker launch."""
