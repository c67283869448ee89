"""File handles, sockets and child processes: loading a payload never acts outside the process."""

from __future__ import annotations

import io
import os
import pickle
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import pc_pickle


@pytest.fixture
def data_file(tmp_path: Path) -> Path:
    path = tmp_path / "data.txt"
    path.write_text("hello world\n")
    return path


def test_write_handle_is_refused_and_the_file_keeps_its_content(data_file: Path) -> None:
    with open(data_file, "w") as fh:
        fh.write("hello world\n")
        fh.flush()
        error: pc_pickle.UnpicklableObjectError | None = None
        try:
            payload = pc_pickle.dumps({"fh": fh})
        except pc_pickle.UnpicklableObjectError as exc:
            error = exc
        else:
            pc_pickle.loads(payload)  # what emptied the file before
    assert data_file.read_text() == "hello world\n"
    assert error is not None
    assert error.path == "obj['fh']"
    assert "read_files=True" in str(error)


def test_read_handle_is_refused_by_default(data_file: Path) -> None:
    with open(data_file) as fh, pytest.raises(pickle.PicklingError, match=r"^obj\[0\]\.handle: "):
        pc_pickle.dumps([_Holder(fh)])


def test_handle_in_a_closure_is_refused_with_its_path(data_file: Path) -> None:
    with open(data_file, "w+") as fh:
        fh.write("kept")
        fh.flush()
        with pytest.raises(pc_pickle.UnpicklableObjectError, match=r"^obj\['f'\]\.__defaults__\[0\]: "):
            pc_pickle.dumps({"f": lambda f=fh: f.read()})
    assert data_file.read_text() == "kept"


@pytest.mark.parametrize(("mode", "kind"), [("r", io.TextIOWrapper), ("rb", io.BufferedReader)])
def test_read_files_reopens_read_only_at_the_saved_position(data_file: Path, mode: str, kind: type) -> None:
    with open(data_file, mode) as fh:
        fh.read(6)
        payload = pc_pickle.dumps({"fh": fh}, read_files=True)
    loaded = pc_pickle.loads(payload)["fh"]
    try:
        assert type(loaded) is kind
        assert loaded.mode == mode
        assert not loaded.writable()
        rest = loaded.read()
        assert rest == ("world\n" if mode == "r" else b"world\n")
    finally:
        loaded.close()
    assert data_file.read_text() == "hello world\n"


def test_read_files_on_an_unbuffered_handle(data_file: Path) -> None:
    with open(data_file, "rb", buffering=0) as fh:
        fh.read(2)
        loaded = pc_pickle.loads(pc_pickle.dumps(fh, read_files=True))
    with loaded:
        assert type(loaded) is io.FileIO
        assert loaded.read() == b"llo world\n"


@pytest.mark.parametrize("mode", ["w", "a", "r+", "wb", "x"])
def test_read_files_still_refuses_writable_handles(tmp_path: Path, mode: str) -> None:
    path = tmp_path / "out.bin"
    if "x" not in mode:
        path.write_bytes(b"keep")
    with open(path, mode) as fh:
        before = path.read_bytes()
        with pytest.raises(pc_pickle.UnpicklableObjectError, match="writable") as info:
            pc_pickle.dumps({"fh": fh}, read_files=True)
    assert info.value.path == "obj['fh']"
    assert path.read_bytes() == before


def test_read_files_refuses_closed_and_unnamed_handles(data_file: Path) -> None:
    with open(data_file) as fh:
        pass
    with pytest.raises(pc_pickle.UnpicklableObjectError, match="closed"):
        pc_pickle.dumps(fh, read_files=True)
    with (
        open(os.open(data_file, os.O_RDONLY)) as by_fd,
        pytest.raises(pc_pickle.UnpicklableObjectError, match="no file name"),
    ):
        pc_pickle.dumps(by_fd, read_files=True)


def test_a_file_gone_by_load_time_is_not_created(data_file: Path) -> None:
    with open(data_file) as fh:
        payload = pc_pickle.dumps(fh, read_files=True)
    data_file.unlink()
    with pytest.raises(FileNotFoundError):
        pc_pickle.loads(payload)
    assert not data_file.exists()


def test_pickler_takes_read_files(data_file: Path) -> None:
    buf = io.BytesIO()
    with open(data_file, "rb") as fh:
        pc_pickle.Pickler(buf, copy_tensor=True, read_files=True).dump([fh])
        with pytest.raises(pc_pickle.UnpicklableObjectError):
            pc_pickle.Pickler(io.BytesIO(), copy_tensor=True).dump([fh])
    with pc_pickle.loads(buf.getvalue())[0] as loaded:
        assert loaded.read() == b"hello world\n"


def test_read_files_must_be_a_bool() -> None:
    with pytest.raises(TypeError, match="read_files must be a bool"):
        pc_pickle.dumps(1, read_files=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="read_files must be a bool"):
        pc_pickle.Pickler(io.BytesIO(), read_files="yes")  # type: ignore[arg-type]


def test_standard_streams_load_as_the_loaders_own() -> None:
    out = pc_pickle.loads(pc_pickle.dumps({"err": sys.__stderr__}))
    assert out["err"] is sys.__stderr__


def test_socket_is_refused_with_its_path() -> None:
    with socket.socket() as sock:
        with pytest.raises(pc_pickle.UnpicklableObjectError, match="outside the process") as info:
            pc_pickle.dumps({"conn": [sock]}, read_files=True)
        assert info.value.path == "obj['conn'][0]"
        with pytest.raises(pc_pickle.UnpicklableObjectError, match=r"^obj\.<closure>\.sock: .*outside"):
            pc_pickle.dumps(lambda: sock.fileno())


def test_child_process_is_refused_with_its_path() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        with pytest.raises(pc_pickle.UnpicklableObjectError, match="outside the process") as info:
            pc_pickle.dumps({"worker": proc})
        assert info.value.path == "obj['worker']"
    finally:
        proc.wait(timeout=60)


class _Holder:
    def __init__(self, handle: object) -> None:
        self.handle = handle
