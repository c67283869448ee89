"""pc_pickle.release: a share payload that will never be loaded gives back its segment or fd (issue 16)."""

from __future__ import annotations

import multiprocessing as mp
import os

import pickle_testutils as tu
import pytest
import torch

import pc_pickle


def _torch_segments_of(pid: int) -> set[str]:
    return {name for name in os.listdir("/dev/shm") if name.startswith(f"torch_{pid}_")}


def test_release_frees_the_file_system_segments_of_payloads_never_loaded() -> None:
    # Before: each dumped-but-never-loaded 'file_system' payload kept its segment in /dev/shm after the
    # producer exited (50 segments per 50 payloads). The producer releases them instead.
    ctx = mp.get_context("fork")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=tu.produce_and_release, args=(child, "file_system", 30))
    proc.start()
    child.close()
    try:
        assert parent.poll(tu.TIMEOUT), "the producer did not finish"
        assert parent.recv_bytes() == b"released"
        proc.join(tu.TIMEOUT)
        assert proc.exitcode == 0
        assert proc.pid is not None
        assert _torch_segments_of(proc.pid) == set()
    finally:
        parent.close()


def _open_fds() -> dict[int, str]:
    """This process's open fds and what each refers to (other threads may open and close fds meanwhile)."""
    fds = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            fds[int(name)] = os.readlink(f"/proc/self/fd/{name}")
        except OSError:  # closed since the listing (or the listing's own fd)
            continue
    return fds


def test_release_gives_back_the_dup_fd_of_a_file_descriptor_payload() -> None:
    t = torch.ones(4).share_memory_()
    pc_pickle.loads(pc_pickle.dumps(t, copy_tensor=False))  # warm up multiprocessing's resource_sharer
    before = _open_fds()
    payloads = [pc_pickle.dumps(t, copy_tensor=False) for _ in range(5)]
    held = {fd: target for fd, target in _open_fds().items() if before.get(fd) != target}
    # one dup'd fd per unloaded payload, held for the consumer, each on the tensor's shared memory
    assert len(held) == 5, held
    assert len(set(held.values())) == 1, held
    for data in payloads:
        pc_pickle.release(data)
    now = _open_fds()
    assert [fd for fd, target in held.items() if now.get(fd) == target] == []


def test_release_consumes_the_payload_like_a_load() -> None:
    data = pc_pickle.dumps(torch.ones(3), copy_tensor=False)
    pc_pickle.release(data)
    with pytest.raises(pc_pickle.SharedHandleError, match="one-shot"):
        pc_pickle.loads(data)
    with pytest.raises(pc_pickle.SharedHandleError):
        pc_pickle.release(data)


def test_release_never_unpickles_the_graph() -> None:
    data = pc_pickle.dumps([torch.ones(2), tu.RefusesToLoad()], copy_tensor=False)
    pc_pickle.release(data)  # loads() would raise "the graph was unpickled"
    copied = pc_pickle.dumps([torch.ones(2), tu.RefusesToLoad()])
    pc_pickle.release(copied)  # a copy payload holds nothing: verified only
    with pytest.raises(RuntimeError, match="the graph was unpickled"):
        pc_pickle.loads(copied)


def test_release_rejects_bad_input() -> None:
    with pytest.raises(TypeError, match="release expects bytes"):
        pc_pickle.release("not bytes")  # type: ignore[arg-type]
    with pytest.raises(pc_pickle.PayloadError):
        pc_pickle.release(b"\x80\x05garbage")
