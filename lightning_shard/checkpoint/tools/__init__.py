"""What is made of a finished checkpoint: one consolidated file and ``inspect`` (``consolidate``), the Hugging Face
and PEFT layouts (``export``), a ``torch.distributed.checkpoint`` directory (``dcp_export``) and a Lightning
``.ckpt`` (``lightning_export``). Builds on ``state``, ``load``, ``io`` and ``format``."""
