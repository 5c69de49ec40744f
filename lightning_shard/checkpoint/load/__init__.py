"""Reading a lightning_shard checkpoint directory back at any world size, each rank only its rows (``directory``),
and summarising and verifying one (``inspect``). Builds on ``io`` and ``format``."""
