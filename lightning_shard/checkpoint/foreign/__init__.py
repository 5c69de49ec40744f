"""Checkpoints other strategies wrote, and the one way to open any checkpoint: what a path holds (``sources``),
``torch.save`` files told apart (``torch_files``) and read without running their pickles (``safe_pickle``),
Lightning ``.ckpt`` files (``lightning_ckpt``) and ``torch.distributed.checkpoint`` directories (``dcp``) read as
one form (``foreign``), loaded into a sharded model (``foreign_load``) or rewritten as a lightning_shard checkpoint
(``convert``). Builds on ``load``, ``save``, ``io`` and ``format``."""
