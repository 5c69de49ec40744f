import pytest
import torch

from lightning_shard.testing import shutdown_ranks


def pytest_collection_modifyitems(config, items):  # noqa: ANN001, ANN201
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


def pytest_sessionfinish(session, exitstatus):  # noqa: ANN001, ANN201
    shutdown_ranks()
