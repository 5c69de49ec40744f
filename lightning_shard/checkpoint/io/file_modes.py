"""The permissions of the files and folders a save or an export writes: what ``open()`` and ``mkdir()`` give under
the process's umask (``0644`` and ``0755`` under the usual ``022``), so that another account on a shared cluster can
read and resume them, as it can ``torch.save``'s files. Some writers are stricter by themselves (``tempfile.mkdtemp``
makes ``0700`` folders, safetensors' ``save_file`` ``0600`` files); what they wrote is given the usual modes before
it is committed."""

from __future__ import annotations

import os
from pathlib import Path


def process_umask() -> int:
    """This process's umask, read without changing it (``os.umask`` would change it for every thread meanwhile)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)  # no /proc: read it by setting it, and set it back at once
    os.umask(mask)
    return mask


def give_default_modes(path: Path) -> None:
    """``path`` and, for a folder, everything under it: files ``0666``, folders ``0777``, less the umask."""
    mask = process_umask()
    if path.is_dir():
        for root, _dirs, files in os.walk(path):
            os.chmod(root, 0o777 & ~mask)
            for name in files:
                os.chmod(os.path.join(root, name), 0o666 & ~mask)
    else:
        os.chmod(path, 0o666 & ~mask)
