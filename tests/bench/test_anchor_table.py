"""The anchor table's pooled prefix at each kernel's block size."""

import pytest

from bench.anchor_table import pooled_prefix

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(("length", "block", "pooled"), [(2048, 16, 1840), (2048, 128, 1792), (512, 128, 384)])
def test_the_pooled_prefix_is_whole_blocks(length, block, pooled):
    assert pooled_prefix(length, block) == pooled
