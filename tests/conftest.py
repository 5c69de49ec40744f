from lightning_shard.testing import shutdown_ranks


def pytest_sessionfinish(session, exitstatus):  # noqa: ANN001, ANN201
    shutdown_ranks()
