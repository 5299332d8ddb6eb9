"""Reading a safetensors file into memory of its own: the tensors safetensors itself reads, and
a file that lies about its layout refused, never read past."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from gateway.engine.models.safetensors_file import read_tensors

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8, torch.bool]

shapes = st.lists(st.integers(min_value=0, max_value=5), min_size=0, max_size=3)


@settings(max_examples=40, deadline=None)
@given(entries=st.lists(st.tuples(st.sampled_from(DTYPES), shapes), min_size=1, max_size=6),
       seed=st.integers(min_value=0, max_value=2**16))
def test_every_tensor_reads_as_safetensors_reads_it(tmp_path_factory: pytest.TempPathFactory,
                                                    entries: list[tuple[torch.dtype, list[int]]],
                                                    seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    tensors = {f"t{i}": (torch.randn(shape, generator=generator) * 100).to(dtype)
               for i, (dtype, shape) in enumerate(entries)}
    path = tmp_path_factory.mktemp("st") / "model.safetensors"
    save_file(tensors, str(path))
    theirs = load_file(str(path))
    ours = dict(read_tensors(path))
    assert ours.keys() == theirs.keys()
    for name, tensor in theirs.items():
        assert ours[name].dtype == tensor.dtype and ours[name].shape == tensor.shape
        assert torch.equal(ours[name], tensor)


def test_tensors_not_wanted_are_not_read(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    save_file({"keep": torch.ones(3), "skip": torch.zeros(2)}, str(path))
    assert [name for name, _ in read_tensors(path, lambda name: name != "skip")] == ["keep"]


def test_the_tensors_live_in_aligned_memory_of_their_own(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    save_file({"a": torch.ones(3), "b": torch.ones(7, 5)}, str(path))
    for _, tensor in read_tensors(path):
        assert tensor.data_ptr() % 64 == 0 and tensor.is_contiguous()


def _with_header(path: Path, header: dict[str, object], data: bytes) -> Path:
    body = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(body)) + body + data)
    return path


@pytest.mark.parametrize(("header", "data", "says"), [
    ({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 8,
     "do not hold"),
    ({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 12]}}, b"\0" * 16,
     "do not hold"),
    ({"w": {"dtype": "F32", "shape": [-4], "data_offsets": [0, 0]}}, b"", "do not hold"),
    ({"w": {"dtype": "Q4", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 16,
     "cannot be read"),
    ({"w": {"shape": [4], "data_offsets": [0, 16]}}, b"\0" * 16, "cannot be read"),
], ids=["past the end", "wrong size", "negative shape", "unknown dtype", "no dtype"])
def test_a_header_that_lies_is_refused(tmp_path: Path, header: dict[str, object], data: bytes,
                                       says: str) -> None:
    path = _with_header(tmp_path / "model.safetensors", header, data)
    with pytest.raises(ValueError, match=says):
        list(read_tensors(path))


def test_a_header_longer_than_the_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    path.write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    with pytest.raises(ValueError, match="a header of"):
        list(read_tensors(path))


def test_a_header_that_is_not_json_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    path.write_bytes(struct.pack("<Q", 3) + b"{x}")
    with pytest.raises(ValueError, match="not JSON"):
        list(read_tensors(path))
