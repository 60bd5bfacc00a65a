"""Byte sizes as users write them (max_shard_size, max_memory, --max-memory) and as reports print them."""

import pytest

from gpuformers.sizes import format_size, parse_size


def test_parse_size():
    assert parse_size("5GB") == 5 * 10**9
    assert parse_size("500MB") == 500 * 10**6
    assert parse_size("2GiB") == 2 * 2**30
    assert parse_size(" 1.5 kb ") == 1500
    assert parse_size(1234) == 1234
    with pytest.raises(ValueError, match=r"size = '5 gigs' is not a size: .* '5GB'"):
        parse_size("5 gigs")
    with pytest.raises(ValueError, match="more than 0"):
        parse_size(0)
    assert parse_size("0GB", allow_zero=True) == 0  # max_memory may leave a device out with 0
    with pytest.raises(ValueError, match=r"max_memory\['cpu'\] = -5 must be at least 0"):
        parse_size(-5, name="max_memory['cpu']", allow_zero=True)


def test_format_size():
    assert format_size(3 * 2**30 // 2) == "1.50 GiB"
    assert format_size(12 * 2**20) == "12.0 MiB"
    assert format_size(None) == "?"
