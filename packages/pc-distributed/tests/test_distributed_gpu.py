"""NCCL paths on CUDA devices (skipped without CUDA; run by ``nox -s gpu``)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

import pc_distributed as pd


def _nccl_checks(rank: int) -> dict[str, Any]:
    torch.cuda.set_device(rank)
    world = pd.get_world()
    assert world is not None
    size = world.world_size
    group = world.create_collective_group(list(range(size)), timeout=60)
    t = torch.full((4,), float(rank + 1), device=f"cuda:{rank}")
    group.all_reduce(t)
    b = torch.full((2,), float(rank), device=f"cuda:{rank}")
    group.broadcast(b, 0)
    tl = [torch.full((3,), float(rank + 1), device=f"cuda:{rank}")]
    group.all_reduce_multigpu(tl, op=dist.ReduceOp.SUM)
    gathered = [torch.zeros(1, device=f"cuda:{rank}") for _ in range(size)]
    group.all_gather(gathered, torch.tensor([float(rank)], device=f"cuda:{rank}"))
    group.barrier()
    return {
        "all_reduce": t.cpu().tolist(),
        "broadcast": b.cpu().tolist(),
        "multigpu": tl[0].cpu().tolist(),
        "all_gather": [g.item() for g in gathered],
    }


@pytest.mark.gpu
def test_nccl_collectives_one_rank_per_device(cuda_devices: int) -> None:
    size = min(cuda_devices, 2)
    results = pd.run_world(_nccl_checks, size, dist_backend="nccl", init_rpc=False, timeout=170)
    total = float(sum(range(1, size + 1)))
    for r in results:
        assert r["all_reduce"] == [total] * 4
        assert r["broadcast"] == [0.0, 0.0]
        assert r["multigpu"] == [total] * 3
        assert r["all_gather"] == [float(i) for i in range(size)]


def _gloo_cuda_point_to_point(rank: int) -> dict[str, Any]:
    world = pd.get_world()
    assert world is not None
    group = world.create_collective_group([0, 1], timeout=60)
    if rank == 0:
        group.send(torch.arange(4.0, device="cuda:0"), 1)
        group.isend(torch.full((2,), 7.0, device="cuda:0"), 1).wait()
        return {}
    got = torch.zeros(4, device="cuda:0")
    sender = group.recv(got, src=0)
    later = torch.zeros(2, device="cuda:0")
    group.irecv(later, src=0).wait(timeout=60)
    return {
        "sender": sender,
        "got": got.cpu().tolist(),
        "later": later.cpu().tolist(),
        "device": str(got.device),
    }


@pytest.mark.gpu
def test_cuda_tensors_cross_gloo_point_to_point_through_the_host(cuda_devices: int) -> None:
    # Two ranks sharing cuda:0 over gloo: handed to gloo's send/recv as they are, CUDA tensors abort the
    # process.
    results = pd.run_world(_gloo_cuda_point_to_point, 2, backend="gloo", init_rpc=False, timeout=170)
    assert results[1] == {"sender": 0, "got": [0.0, 1.0, 2.0, 3.0], "later": [7.0, 7.0], "device": "cuda:0"}


def _doubled_with_device(t: torch.Tensor) -> tuple[torch.Tensor, str]:
    return t * 2, str(t.device)


def _c10d_cuda_calls(rank: int) -> dict[str, Any]:
    world = pd.get_world()
    assert world is not None
    group = world.create_rpc_group("cuda", ["0", "1"])
    if rank == 1:
        group.register("double", _doubled_with_device)
    group.barrier(timeout=60)
    out: dict[str, Any] = {}
    if rank == 0:
        sent = torch.arange(4.0, device="cuda:0")
        value, seen = group.registered_sync("double", args=(sent,))
        out["sync"] = (value.device.type, value.cpu().tolist(), seen)
        value, seen = group.remote("1", _doubled_with_device, args=(sent,)).to_here()
        out["remote"] = (value.device.type, value.cpu().tolist(), seen)
        out["lambda"] = group.rpc_sync("1", lambda t: (t + 1).device.type, args=(sent,))
    group.barrier(timeout=60)
    return out


@pytest.mark.gpu
def test_c10d_backend_carries_cuda_tensors_both_ways(cuda_devices: int) -> None:
    """On the c10d RPC backend a CUDA tensor crosses a call and comes back on CUDA (two ranks, one GPU)."""
    results = pd.run_world(_c10d_cuda_calls, 2, rpc_backend="c10d", timeout=170)
    expected = ("cuda", [0.0, 2.0, 4.0, 6.0], "cuda:0")
    assert results[0]["sync"] == expected
    assert results[0]["remote"] == expected
    assert results[0]["lambda"] == "cuda"


def _copies_seen(prof: Any) -> dict[str, int]:
    """Per direction ("Memcpy DtoH", "Memcpy HtoD", ...), the copies the profiler saw on the device."""
    seen: dict[str, int] = {}
    for event in prof.key_averages():
        if event.key.startswith("Memcpy "):
            direction = event.key.split(" (")[0]
            seen[direction] = seen.get(direction, 0) + event.count
    return seen


def _c10d_host_copies(rank: int) -> dict[str, Any]:
    from torch.profiler import ProfilerActivity, profile

    world = pd.get_world()
    assert world is not None
    group = world.create_rpc_group("copies", ["0", "1"])
    if rank == 1:
        group.register("double", _doubled_with_device)
    sent = torch.ones(1 << 20, device="cuda:0")  # 4 MB: a part of the message
    probe = torch.ones(4, device="cuda:0")
    group.barrier(timeout=60)
    if rank == 0:
        group.registered_sync("double", args=(sent,))  # the first call sets up what later calls reuse
    group.barrier(timeout=60)
    out: dict[str, Any] = {}
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        group.barrier(timeout=60)
        probe.cpu()  # a copy the profiler must see: without it, this profiler sees no device copies
        if rank == 0:
            value, _ = group.registered_sync("double", args=(sent,))
        group.barrier(timeout=60)
        torch.cuda.synchronize()
    out["copies"] = _copies_seen(prof)
    if rank == 0:
        out["value"] = (value.device.type, float(value.sum()))  # read after profiling: .sum() is a copy too
    group.barrier(timeout=60)
    return out


@pytest.mark.gpu
def test_c10d_moves_a_cuda_tensor_through_the_host_once_each_way(cuda_devices: int) -> None:
    """Over gloo (two ranks on one GPU) a CUDA argument costs one device-to-host copy on the caller and one
    host-to-device copy on the callee, and the CUDA result the same the other way: nothing more."""
    results = pd.run_world(_c10d_host_copies, 2, rpc_backend="c10d", timeout=170)
    if any(r["copies"].get("Memcpy DtoH", 0) == 0 for r in results):
        pytest.skip(f"this profiler sees no device copies (it saw {[r['copies'] for r in results]})")
    assert results[0]["value"] == ("cuda", 2.0 * (1 << 20))
    # each rank: the probe's copy, plus the one copy out of what it sends and the one copy in of what it gets
    assert results[0]["copies"] == {"Memcpy DtoH": 2, "Memcpy HtoD": 1}
    assert results[1]["copies"] == {"Memcpy DtoH": 2, "Memcpy HtoD": 1}


def _tensorpipe_cuda_refusals(rank: int) -> dict[str, Any]:
    world = pd.get_world()
    assert world is not None
    group = world.create_rpc_group("refusals", ["0", "1"])
    if rank == 1:
        group.register("double", _doubled_with_device)
    group.barrier(timeout=60)
    out: dict[str, Any] = {}
    if rank == 0:
        sent = torch.ones(4, device="cuda:0")
        for how in ("sync", "async"):
            try:
                if how == "sync":
                    group.registered_sync("double", args=(sent,))
                else:
                    group.registered_async("double", args=(sent,)).wait()
            except Exception as exc:
                out[how] = (type(exc).__name__, str(exc))
        out["after"] = group.registered_sync("double", args=(sent.cpu(),))[1]  # the group still works
    group.barrier(timeout=60)
    return out


@pytest.mark.gpu
def test_tensorpipe_refuses_a_cuda_argument_with_a_value_error_naming_c10d(cuda_devices: int) -> None:
    results = pd.run_world(_tensorpipe_cuda_refusals, 2, rpc_backend="tensorpipe", timeout=170)
    for how in ("sync", "async"):
        kind, text = results[0][how]
        assert kind == "ValueError", (how, kind, text)
        assert "rpc_backend='c10d'" in text
    assert results[0]["after"] == "cpu"
