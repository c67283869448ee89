"""CollectiveGroup on a real 3-process gloo world: every collective, point-to-point, *_multigpu, non-members.

One spawned world runs all checks (``_collective_checks``) and returns its observations; each test asserts one
behaviour on them, so a failure stays attributable.
"""

from __future__ import annotations

import queue
import threading
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from distributed_testutils import fork_unless_cuda

import pc_distributed as pd


def _expect(exc_type: type[BaseException], fn: Any, *args: Any, **kwargs: Any) -> str:
    try:
        fn(*args, **kwargs)
    except exc_type as exc:
        return str(exc)
    raise AssertionError(f"{fn!r} did not raise {exc_type.__name__}")


def _staged_point_to_point(group: pd.CollectiveGroup, rank: int) -> dict[str, Any]:
    """The host-staged path of send/recv/isend/irecv (a CUDA tensor's on gloo), forced for CPU tensors.

    Every received value must land in the caller's own tensor object, also for an ``irecv`` once ``wait()``
    returned.
    """
    from pc_distributed import _torch_dist

    carries = _torch_dist.p2p_carries
    _torch_dist.p2p_carries = lambda backend, device_type: False  # type: ignore[assignment]
    received_into: list[torch.Tensor] = []  # the tensors torch's recv/irecv were given
    originals = {name: getattr(dist, name) for name in ("send", "recv", "isend", "irecv")}

    def spy(name: str) -> Any:
        def op(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if "recv" in name:
                received_into.append(tensor)
            return originals[name](tensor, *args, **kwargs)

        return op

    for name in originals:
        setattr(dist, name, spy(name))
    got: dict[str, Any] = {}
    callers: list[torch.Tensor] = []
    try:
        if rank == 0:
            callers += [torch.tensor([20.0, 21.0]), torch.tensor([22.0]), torch.zeros(1)]
            group.send(callers[0], 1)
            group.isend(callers[1], 1).wait()
            got["staged_any"] = (group.irecv(callers[2]).wait(timeout=20), callers[2].item())
        elif rank == 1:
            callers += [torch.zeros(2), torch.zeros(1)]
            got["staged_recv"] = (group.recv(callers[0], src=0), callers[0].tolist())
            handle = group.irecv(callers[1], src=0)
            got["staged_irecv"] = (handle.wait(timeout=20), callers[1].item())
            got["staged_irecv_again"] = (handle.wait(timeout=20), callers[1].item())  # the copy is made once
        else:
            callers.append(torch.tensor([23.0]))
            group.send(callers[0], 0)
    finally:
        _torch_dist.p2p_carries = carries  # type: ignore[assignment]
        for name, fn in originals.items():
            setattr(dist, name, fn)
    group.barrier()
    # the any-source receive runs torch's recv on a thread of its own, which the spy sees too
    # (a send of a CPU tensor hands torch the tensor itself: ``.cpu()`` copies only what is elsewhere)
    got["staged_receives"] = (len(received_into), any(r is c for r in received_into for c in callers))
    return got


def _collective_checks(rank: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    world = pd.get_world()
    assert world is not None
    out: dict[str, Any] = {
        "rank": pd.get_cur_rank(),
        "name": pd.get_cur_name(),
        "members": world.get_members(),
        "ranks": world.get_ranks(),
        "initialized": pd.is_world_initialized(),
    }
    group = world.create_collective_group([2, 0, 1], timeout=20)
    out["size"] = group.size()

    # point to point: 0 -> 1 with a given source, 2 -> 0 from any source
    if rank == 0:
        group.send(torch.tensor([10.0]), 1)
        buf = torch.zeros(1)
        out["any_src"] = group.irecv(buf, src=None).wait(timeout=20)
        out["any_val"] = buf.item()
        buf2 = torch.zeros(1)
        out["recv_any"] = group.recv(buf2)
        out["recv_any_val"] = buf2.item()
    elif rank == 1:
        buf = torch.zeros(1)
        out["recv_src"] = group.recv(buf, src=0)
        out["recv_val"] = buf.item()
        group.isend(torch.tensor([11.0]), 0).wait()
    else:
        group.send(torch.tensor([12.0]), 0)
    group.barrier()
    out.update(_staged_point_to_point(group, rank))

    t = torch.tensor([float(rank)])
    group.broadcast(t, 2)
    out["broadcast"] = t.item()
    t = torch.tensor([rank + 1.0])
    group.all_reduce(t)
    out["all_reduce"] = t.item()
    t = torch.tensor([float(rank + 3)])  # 3 + 4 + 5 = 12 on the destination
    group.reduce(t, 1)
    out["reduce"] = t.item() if rank == 1 else None
    gathered = [torch.zeros(2) for _ in range(3)]
    group.all_gather(gathered, torch.tensor([rank, rank * 10.0]))
    out["all_gather"] = [g.tolist() for g in gathered]
    glist = [torch.zeros(1) for _ in range(3)] if rank == 0 else None
    group.gather(torch.tensor([rank * 2.0]), glist, dst=0)
    out["gather"] = [g.item() for g in glist] if glist is not None else None
    recv = torch.full((1,), -1.0)
    group.scatter(recv, [torch.tensor([float(i)]) for i in range(3)] if rank == 2 else None, src=2)
    out["scatter"] = recv.item()
    work = group.all_reduce(torch.ones(3), async_op=True)
    work.wait()

    # *_multigpu over per-process lists
    tl = [torch.tensor([rank + 1.0]), torch.tensor([10.0 * (rank + 1)])]
    group.all_reduce_multigpu(tl)
    out["ar_multi"] = [x.item() for x in tl]
    tl = [torch.tensor([float(rank)]), torch.tensor([float(rank)])]
    group.all_reduce_multigpu(tl, op=dist.ReduceOp.AVG)
    out["ar_multi_avg"] = [x.item() for x in tl]
    tl = [torch.tensor([rank * 1.0]), torch.tensor([rank * 1.0 + 0.5])]
    group.broadcast_multigpu(tl, src=1, src_tensor=1)
    out["bc_multi"] = [x.item() for x in tl]
    tl = [torch.tensor([1.0]), torch.tensor([2.0])]
    group.reduce_multigpu(tl, dst=0, dst_tensor=1)
    out["red_multi"] = tl[1].item() if rank == 0 else None
    outs = [[torch.zeros(1) for _ in range(6)] for _ in range(2)]
    group.all_gather_multigpu(outs, [torch.tensor([rank * 10.0]), torch.tensor([rank * 10.0 + 1])])
    out["ag_multi"] = [[x.item() for x in o] for o in outs]
    tl = [torch.tensor([rank + 1.0]), torch.tensor([1.0])]
    group.all_reduce_multigpu(tl, async_op=True).wait()
    out["ar_multi_async"] = [x.item() for x in tl]
    out.update(_two_threads_issue_a_collective_at_once(world, group, rank))

    # a subgroup {0, 2}: every rank enters creation; irecv(src=k) works there; rank 1 is not a member
    sub = world.create_collective_group([0, 2], timeout=20)
    if rank == 0:
        buf = torch.zeros(1)
        out["sub_irecv"] = sub.irecv(buf, src=2).wait(timeout=20)
        out["sub_irecv_val"] = buf.item()
    elif rank == 2:
        sub.send(torch.tensor([42.0]), 0)
    else:
        out["non_member"] = _expect(RuntimeError, sub.all_reduce, torch.ones(1))
        out["non_member_send"] = _expect(RuntimeError, sub.send, torch.ones(1), 0)
        out["is_member"] = sub.is_member()
    out["bad_dst"] = _expect(ValueError, group.send, torch.ones(1), 7)
    out["bad_dst_type"] = _expect(TypeError, group.reduce, torch.ones(1), "0")
    out["bad_list"] = _expect(ValueError, group.all_reduce_multigpu, [])
    out["bad_ranks"] = _expect(ValueError, world.create_collective_group, [0, 5])
    out["pickle"] = _expect(TypeError, __import__("pickle").dumps, group)

    # a rank that does not enter creation: the others time out naming it
    if rank != 2:
        out["missing_rank"] = _expect(TimeoutError, world.create_collective_group, [0, 1], timeout=2)
    group.barrier()
    sub.destroy()
    group.destroy()
    out["destroyed"] = _expect(RuntimeError, group.barrier)
    return out


def _two_threads_issue_a_collective_at_once(
    world: pd.World, group: pd.CollectiveGroup, rank: int
) -> dict[str, Any]:
    """Rank 0: two threads all_reduce at once; the others join only after one of them was refused.

    Whichever thread enters first waits inside its all_reduce for the peers, which wait for "go"; the other
    must be refused at once (it would otherwise issue a second collective in an order the peers cannot match).
    """
    if rank != 0:
        world.store.wait(["overlap/go"], timedelta(seconds=20))
        group.all_reduce(torch.ones(1))
        return {}
    outcomes: queue.Queue[tuple[str, str]] = queue.Queue()

    def issue() -> None:
        t = torch.ones(1)
        try:
            group.all_reduce(t)
        except RuntimeError as exc:
            outcomes.put(("refused", str(exc)))
        else:
            outcomes.put(("sum", str(t.item())))

    threads = [threading.Thread(target=issue, name=f"issuer-{tag}") for tag in "AB"]
    for thread in threads:
        thread.start()
    first = outcomes.get(timeout=20)  # the refusal: the peers have not joined, so nothing else can end first
    world.store.set("overlap/go", b"1")
    second = outcomes.get(timeout=20)
    for thread in threads:
        thread.join(20)
    return {"overlap": [first, second]}


@pytest.fixture(scope="module")
def observed() -> list[dict[str, Any]]:
    # dist_timeout bounds the rendezvous: 60 s, since a 30 s rendezvous once ran out under load average 10
    return pd.run_world(
        _collective_checks, 3, timeout=150, init_rpc=False, dist_timeout=60, start_method=fork_unless_cuda()
    )


def test_a_second_thread_issuing_a_collective_meanwhile_is_refused(observed: list[dict[str, Any]]) -> None:
    (kind, message), second = observed[0]["overlap"]
    assert kind == "refused"
    assert "one thread at a time" in message
    assert "collective group [0, 1, 2]" in message
    assert "issuer-" in message  # names the threads
    assert second == ("sum", "3.0")  # the thread that entered first completed with the peers


def test_world_info(observed: list[dict[str, Any]]) -> None:
    for rank, o in enumerate(observed):
        assert o["rank"] == rank
        assert o["name"] == str(rank)
        assert o["members"] == ["0", "1", "2"]
        assert o["ranks"] == [0, 1, 2]
        assert o["initialized"] is True
        assert o["size"] == 3


def test_point_to_point_returns_sender(observed: list[dict[str, Any]]) -> None:
    assert (observed[1]["recv_src"], observed[1]["recv_val"]) == (0, 10.0)
    got = {
        (observed[0]["any_src"], observed[0]["any_val"]),
        (observed[0]["recv_any"], observed[0]["recv_any_val"]),
    }
    assert got == {(1, 11.0), (2, 12.0)}


def test_host_staged_point_to_point_lands_in_the_callers_tensor(observed: list[dict[str, Any]]) -> None:
    assert observed[1]["staged_recv"] == (0, [20.0, 21.0])
    assert observed[1]["staged_irecv"] == (0, 22.0)
    assert observed[1]["staged_irecv_again"] == (0, 22.0)
    assert observed[0]["staged_any"] == (2, 23.0)
    # every receive went into a host buffer, never into the caller's tensor itself
    assert [o["staged_receives"] for o in observed] == [(1, False), (2, False), (0, False)]


@pytest.mark.parametrize(
    ("backend", "device_type", "carries"),
    [
        ("gloo", "cpu", True),
        ("gloo", "cuda", False),  # gloo's send/recv of a CUDA tensor aborts the process
        ("GLOO", "cuda", False),
        ("nccl", "cuda", True),
        ("cpu:gloo,cuda:nccl", "cuda", True),
        ("cpu:gloo,cuda:gloo", "cuda", False),
        ("mpi", "cuda", True),  # a backend not known here is trusted with what torch hands it
    ],
)
def test_which_backends_carry_a_device_in_point_to_point(
    backend: str, device_type: str, carries: bool
) -> None:
    from pc_distributed import _torch_dist

    assert _torch_dist.p2p_carries(backend, device_type) is carries


def test_collectives(observed: list[dict[str, Any]]) -> None:
    for rank, o in enumerate(observed):
        assert o["broadcast"] == 2.0
        assert o["all_reduce"] == 6.0
        assert o["all_gather"] == [[0.0, 0.0], [1.0, 10.0], [2.0, 20.0]]
        assert o["scatter"] == float(rank)
    assert observed[1]["reduce"] == 12.0
    assert observed[0]["gather"] == [0.0, 2.0, 4.0]


def test_multigpu_on_cpu_lists(observed: list[dict[str, Any]]) -> None:
    for o in observed:
        assert o["ar_multi"] == [66.0, 66.0]  # (1+10) + (2+20) + (3+30)
        assert o["ar_multi_avg"] == [1.0, 1.0]  # mean of 0,0,1,1,2,2
        assert o["bc_multi"] == [1.5, 1.5]
        assert o["ag_multi"] == [[0.0, 1.0, 10.0, 11.0, 20.0, 21.0]] * 2
        assert o["ar_multi_async"] == [9.0, 9.0]  # (1+1) + (2+1) + (3+1)
    assert observed[0]["red_multi"] == 9.0


def test_irecv_with_source_on_subgroup(observed: list[dict[str, Any]]) -> None:
    assert (observed[0]["sub_irecv"], observed[0]["sub_irecv_val"]) == (2, 42.0)


def test_non_member_gets_clear_error(observed: list[dict[str, Any]]) -> None:
    o = observed[1]
    assert "not a member" in o["non_member"]
    assert "not a member" in o["non_member_send"]
    assert o["is_member"] is False


def test_bad_input_and_lifecycle_errors(observed: list[dict[str, Any]]) -> None:
    o = observed[0]
    assert "7" in o["bad_dst"]
    assert "int global rank" in o["bad_dst_type"]
    assert "non-empty list" in o["bad_list"]
    assert "[0, 5]" in o["bad_ranks"]
    assert "cannot be pickled" in o["pickle"]
    assert "destroyed" in o["destroyed"]


def test_rank_missing_from_group_creation_is_named(observed: list[dict[str, Any]]) -> None:
    for o in observed[:2]:
        assert "[2]" in o["missing_rank"]
