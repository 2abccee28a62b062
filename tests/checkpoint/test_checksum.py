"""Tests for checkpoint/checksum.py."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch

from bubbleguard.checkpoint.checksum import checksum, checksum_update


@pytest.mark.parametrize("algorithm", ["sum64", "crc32"])
def test_any_single_byte_change_is_detected(algorithm: str) -> None:
    data = torch.randint(0, 256, (4096,), dtype=torch.uint8)
    reference = checksum(data, algorithm)
    for pos in (0, 7, 8, 2047, 4095):
        changed = data.clone()
        changed[pos] ^= 0x10
        assert checksum(changed, algorithm) != reference


def test_crc32_is_zlibs_and_sum64_wraps() -> None:
    data = torch.full((16,), 255, dtype=torch.uint8)
    assert checksum(data, "crc32") == zlib.crc32(bytes(data.tolist()))
    assert checksum(data, "sum64") == (2 * (2**64 - 1)) % 2**64


def test_bad_input_is_named() -> None:
    with pytest.raises(ValueError, match="multiple of 8 bytes, got 5"):
        checksum(torch.zeros(5, dtype=torch.uint8), "sum64")
    with pytest.raises(ValueError, match="unknown checksum 'md5'"):
        checksum(torch.zeros(8, dtype=torch.uint8), "md5")


@pytest.mark.parametrize("algorithm", ["sum64", "crc32"])
@pytest.mark.parametrize("block", [8, 64, 1000, 4096])
def test_block_by_block_equals_the_whole(algorithm: str, block: int) -> None:
    data = torch.randint(0, 256, (4096,), dtype=torch.uint8)
    if algorithm == "sum64":
        block -= block % 8
    value = 0
    for start in range(0, data.numel(), block):
        value = checksum_update(value, data[start:start + block].numpy(), algorithm)
    assert value == checksum(data, algorithm)


def test_block_bad_input_is_named() -> None:
    with pytest.raises(ValueError, match="blocks of a multiple of 8 bytes, got 12"):
        checksum_update(0, np.zeros(12, dtype=np.uint8), "sum64")
    with pytest.raises(ValueError, match="unknown checksum 'md5'"):
        checksum_update(0, np.zeros(8, dtype=np.uint8), "md5")
