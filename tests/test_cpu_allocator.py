"""The CPU allocator setting: sharding on CPU makes glibc keep large freed blocks for the next request (autograd's
weight gradients, the optimizer's temporaries), so that a steady training step stops faulting in fresh pages for
them; the user's own allocator settings win; a bad value is refused up front."""

from __future__ import annotations

import json
import platform
import statistics
import sys
import textwrap
from functools import partial

import pytest

from lightning_shard import ShardStrategy
from lightning_shard.engine.cpu_allocator import AllocatorSetting, _user_chose_allocator
from lightning_shard.engine.option_choices import CpuAllocator
from lightning_shard.fabric import ShardStrategy as FabricShardStrategy
from tests.jobs import SESSION_ENV, free_port, run_early

GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"

# One process, world size 1 on gloo: two Linear(1024, 9216) layers, whose weight gradients (36 MiB each) and AdamW
# temporaries are above glibc's largest adaptive mmap threshold (32 MiB). Prints the minor page faults of the
# steady steps and what the engine did to the allocator.
_STEPS = textwrap.dedent(
    """
    import json, os, resource, sys
    import torch
    import torch.distributed as dist
    from torch import nn
    from lightning_shard.engine import cpu_allocator, shard_model

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[2], rank=0, world_size=1)
    model = nn.Sequential(nn.Linear(1024, 9216), nn.ReLU(), nn.Linear(9216, 1024))
    shard_model(model, auto_wrap_policy={nn.Linear}, device="cpu", cpu_allocator=sys.argv[1])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(4, 1024)
    faults = []
    for step in range(8):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    dist.destroy_process_group()
    print(json.dumps({"faults": faults[2:], "setting": cpu_allocator._applied and cpu_allocator._applied.value}))
    """
)


def _steady_faults(choice: str, **env: str) -> dict:
    """The run, as an early check (see [Note: early checks] in tests/jobs.py)."""
    environ = {k: v for k, v in SESSION_ENV.items() if not k.startswith("MALLOC_")}
    environ.update(OMP_NUM_THREADS="1", **env)
    out = run_early([sys.executable, "-c", _STEPS, choice, str(free_port())], env=environ, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def _system_and_reuse() -> tuple[dict, dict]:
    return _steady_faults("system"), _steady_faults("reuse")


@pytest.mark.skipif(not GLIBC, reason="the setting applies to glibc's malloc only")
@pytest.mark.early(check=_system_and_reuse)
def test_reuse_stops_fresh_pages_for_gradients_and_optimizer_temporaries(early: tuple[dict, dict]) -> None:
    system, reuse = early
    gradient_pages = 1024 * 9216 * 4 // 4096  # one weight gradient in 4 KiB pages
    assert min(system["faults"]) > gradient_pages, system  # the model does fault them in fresh every step
    assert reuse["setting"] == AllocatorSetting.APPLIED.value
    # A typical step faults in nothing; now and then the heap still grows by a block or two (a gradient's pages),
    # so over all six steady steps it faults in less than the system allocator does in one.
    assert statistics.median(reuse["faults"]) < gradient_pages // 4, (reuse, system)
    assert sum(reuse["faults"]) < min(system["faults"]), (reuse, system)


@pytest.mark.skipif(not GLIBC, reason="the setting applies to glibc's malloc only")
@pytest.mark.early(check=partial(_steady_faults, "reuse", MALLOC_MMAP_THRESHOLD_="65536"))
def test_the_users_malloc_settings_win(early: dict) -> None:
    chosen = early
    assert chosen["setting"] == AllocatorSetting.USER_CHOSEN.value


@pytest.mark.parametrize(
    "environ",
    [
        {"MALLOC_TRIM_THRESHOLD_": "0"},
        {"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=65536"},
        {"LD_PRELOAD": "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"},
        {"LD_PRELOAD": "libtcmalloc_minimal.so.4"},
    ],
)
def test_what_counts_as_the_users_choice(environ: dict[str, str]) -> None:
    assert _user_chose_allocator(environ)


def test_an_unrelated_environment_is_not_a_choice() -> None:
    assert not _user_chose_allocator({"GLIBC_TUNABLES": "glibc.rtld.optional_static_tls=2048", "LD_PRELOAD": ""})


@pytest.mark.parametrize("strategy", [ShardStrategy, FabricShardStrategy])
def test_an_unknown_allocator_choice_is_refused_when_the_strategy_is_built(strategy: type) -> None:
    with pytest.raises(ValueError, match=r"Unknown cpu_allocator 'fast'. Valid values are: 'reuse', 'system'"):
        strategy(cpu_allocator="fast")
    assert strategy(cpu_allocator="system").cpu_allocator is CpuAllocator.SYSTEM
    assert strategy().cpu_allocator is CpuAllocator.REUSE


def test_both_front_ends_hand_the_choice_to_the_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch
    from torch import nn

    from lightning_shard.common import setup
    from lightning_shard.common.options import ShardOptions

    seen = []

    def fake_apply_parallelism(*args: object, **kwargs: object) -> object:
        seen.append(kwargs["cpu_allocator"])
        raise RuntimeError("stop here")

    monkeypatch.setattr(setup, "apply_parallelism", fake_apply_parallelism)
    for choice in ("system", "reuse"):
        with pytest.raises(RuntimeError, match="stop here"):
            setup.setup_sharded_module(nn.Linear(2, 2), ShardOptions.parse(cpu_allocator=choice), None,  # type: ignore[arg-type]
                                       torch.device("cpu"), None)
    assert seen == [CpuAllocator.SYSTEM, CpuAllocator.REUSE]
