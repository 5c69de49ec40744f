"""Writing a checkpoint directory: each rank's rows, the index and the trainer state (``directory``), the optimizers'
part (``optimizer_entries``), small tensors stored whole (``whole``) and tensor-parallel pieces (``tensor_parallel``),
committed atomically, locally or to object storage (``commit``), in the background (``background``). Builds on
``io`` and ``format``."""
