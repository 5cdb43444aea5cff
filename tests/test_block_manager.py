"""BlockManager: exact block ids through allocate / append / free (pure Python)."""


import pytest

from batchfleet.worker.engine.native.block_manager import BlockManager, blocks_for
from batchfleet.worker.engine.native.sequence import Sequence

pytestmark = pytest.mark.unit  # pure: no Redis, no model, no subprocess


def seq(name: str, n: int) -> Sequence:
    return Sequence(id=name, token_ids=list(range(n)), max_new_tokens=8)


def test_pure_python():
    import batchfleet.worker.engine.native.block_manager as bm
    import batchfleet.worker.engine.native.scheduler as sc
    import batchfleet.worker.engine.native.sequence as sq

    for mod in (bm, sc, sq):
        src = open(mod.__file__).read()
        assert "import torch" not in src and "redis" not in src


def test_blocks_for():
    assert [blocks_for(n, 4) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]


def test_allocate_lowest_ids_first_and_free_to_back():
    bm = BlockManager(num_blocks=8, block_size=4)
    a, b = seq("a", 5), seq("b", 4)
    bm.allocate(a, 5)
    bm.allocate(b, 4)
    assert a.block_table == [0, 1] and b.block_table == [2]
    assert (bm.num_used, bm.num_free) == (3, 5)
    bm.free(a)
    assert a.block_table == [] and bm.num_free == 7
    c = seq("c", 12)
    bm.allocate(c, 12)
    assert c.block_table == [3, 4, 5]  # untouched ids first, freed 0, 1 went to the back
    d = seq("d", 9)
    bm.allocate(d, 9)
    assert d.block_table == [6, 7, 0]
    assert bm.peak_used == 7


def test_append_slot_only_on_block_boundary():
    bm = BlockManager(num_blocks=4, block_size=4)
    a = seq("a", 3)
    bm.allocate(a, 3)
    a.num_cached = 3
    assert not bm.needs_block(a)
    bm.append_slot(a)  # slot 3 is still in block 0
    assert a.block_table == [0]
    a.num_cached = 4
    assert bm.needs_block(a)
    bm.append_slot(a)
    assert a.block_table == [0, 1]
    assert bm.slot(a, 4) == 4 and bm.slot(a, 3) == 3


def test_slot_mapping_uses_table():
    bm = BlockManager(num_blocks=6, block_size=4)
    x, y = seq("x", 8), seq("y", 5)
    bm.allocate(x, 8)
    bm.free(x)
    bm.allocate(y, 5)
    assert y.block_table == [2, 3]
    assert [bm.slot(y, p) for p in range(5)] == [8, 9, 10, 11, 12]


def test_exhaustion_raises_and_can_checks():
    bm = BlockManager(num_blocks=2, block_size=4)
    a = seq("a", 8)
    assert bm.can_allocate(8) and not bm.can_allocate(8, reserve=1) and not bm.can_allocate(9)
    bm.allocate(a, 8)
    a.num_cached = 8
    assert not bm.can_append(a)
    with pytest.raises(RuntimeError):
        bm.append_slot(a)
    with pytest.raises(RuntimeError):
        bm.allocate(seq("b", 1), 1)
