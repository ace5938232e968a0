"""One size syntax for every command: make-model --target-size, generate --cache-bytes, iod --arena-bytes."""

import pytest

from moestream.common.units import parse_size


@pytest.mark.parametrize("text,n", [("2GiB", 2 << 30), ("2G", 2 << 30), ("500MB", 500_000_000), ("1234", 1234),
                                    ("1.5 KiB", 1536), ("1.5k", 1536), ("512M", 512 << 20), (123, 123)])
def test_parse_size(text, n):
    assert parse_size(text) == n


@pytest.mark.parametrize("text", ["2 parsecs", "GiB", "-1MB", "", "4XB", -1])
def test_parse_size_rejects(text):
    with pytest.raises(ValueError, match="bad size"):
        parse_size(text)
