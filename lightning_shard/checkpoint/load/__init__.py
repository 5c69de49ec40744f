"""Reading a lightning_shard checkpoint directory back at any world size, each rank only its rows, and plain or
Hugging Face safetensors files into a sharded model (``load``). Builds on ``io`` and ``format``."""
