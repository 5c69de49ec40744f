"""The checkpoint directory's files, read and written, and what saving and loading share: where a checkpoint lives
(``storage``: local paths and object storage), its member files and their headers (``files``), ``index.json``
(``index``), which file holds which rows (``layout``), reading rows (``reader``) and writing safetensors files
(``writer``), the modes of written files (``file_modes``), every rank raising what any rank raised (``agreement``),
which weights a save holds (``selection``) and the keys of averaged weights (``averaged``). Builds on ``format``
only."""
