"""Writing a checkpoint directory: each rank's rows, the index and the trainer state (``save``), committed
atomically, locally or to object storage (``commit``), in the background (``background``), and the plain state
dicts of a sharded model and its optimizers (``state_dict``). Builds on ``io`` and ``format``."""
