from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch

from lightning_shard.testing import shutdown_ranks
from tests.jobs import AT_ONCE, early_result, start_early_checks


def pytest_collection_modifyitems(config, items):  # noqa: ANN001, ANN201
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


def pytest_collection_finish(session):  # noqa: ANN001, ANN201
    start_early_checks(session.items)  # see [Note: early checks] in tests/jobs.py


def pytest_sessionfinish(session, exitstatus):  # noqa: ANN001, ANN201
    shutdown_ranks()


@pytest.fixture(scope="module")
def background() -> Iterator[ThreadPoolExecutor]:
    """A module's fresh-process jobs, ``AT_ONCE`` at a time (see [Note: jobs in the background] in tests/jobs.py).
    When the module ends, jobs not started are dropped and running ones are waited for (each has its timeout)."""
    jobs = ThreadPoolExecutor(AT_ONCE, thread_name_prefix="job")
    yield jobs
    jobs.shutdown(wait=True, cancel_futures=True)


@pytest.fixture
def early(request: pytest.FixtureRequest) -> Any:
    """What the test's early check returned (``@pytest.mark.early(check=...)``; see [Note: early checks] in
    tests/jobs.py)."""
    return early_result(request.node)
