"""The CPU KV pool on transparent huge pages: the same zeros, 2 MiB-aligned, backed by huge pages where the
kernel's THP mode allows (checked in /proc/self/smaps)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from batchfleet.worker.engine.native import hugepages

THP = Path("/sys/kernel/mm/transparent_hugepage")
needs_madvise = pytest.mark.skipif(hugepages._madvise() is None, reason="no madvise here (not Linux, or no libc found)")


def _thp(setting: str) -> str | None:
    """The selected value of a THP setting ("enabled", "defrag"), or None where THP is absent."""
    try:
        text = (THP / setting).read_text()
    except OSError:
        return None
    return text[text.index("[") + 1:text.index("]")]


def _anon_huge_kb(addr: int) -> int:
    """AnonHugePages (kB) of the mapping of this process that holds ``addr``."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= addr < hi
        elif inside and line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return 0


@pytest.mark.parametrize("shape, dtype", [((3, 2, 700, 16, 4, 64), torch.bfloat16),
                                          ((2, 2, 300, 16, 2, 32), torch.float32), ((2, 3), torch.float32)])
def test_pool_is_zeros_of_the_shape_and_dtype_asked(shape, dtype):
    t = hugepages.zeros(shape, dtype)
    assert t.shape == shape and t.dtype == dtype and t.is_contiguous() and not t.any()
    t.fill_(1)  # writable over its whole length (a view into the allocation, not past it)
    assert bool((t == 1).all())


@needs_madvise
def test_a_large_pool_starts_on_a_huge_page_boundary_and_small_ones_are_plain():
    big = hugepages.zeros((64, 1 << 20), torch.uint8)
    assert big.data_ptr() % hugepages.HUGE == 0
    small = hugepages.zeros((16, 16), torch.float32)  # below one huge page: plain torch.zeros
    assert not small.any()


@needs_madvise
@pytest.mark.skipif(_thp("enabled") not in ("always", "madvise"), reason=f"THP is {_thp('enabled')}, not on")
@pytest.mark.skipif(_thp("defrag") in ("never", "defer"), reason=f"THP defrag is {_thp('defrag')}: no compaction at "
                    "the fault, huge pages only where memory happens to be unfragmented")
def test_a_large_pool_is_backed_by_huge_pages():
    # with defrag always, madvise or defer+madvise a fault in an MADV_HUGEPAGE range compacts memory for its page
    pool = hugepages.zeros((64, 1 << 20), torch.uint8)  # 64 MiB
    assert _anon_huge_kb(pool.data_ptr()) >= 32 * 1024, "less than half of the pool on huge pages"


@needs_madvise
def test_the_runner_allocates_its_cpu_pool_there(tmp_path):
    from batchfleet.worker.engine.models import load_model, make_preset
    from batchfleet.worker.engine.native.runner import ModelRunner

    loaded = load_model(make_preset("tiny", tmp_path), "cpu", "float32")
    runner = ModelRunner(loaded.model, block_size=16, max_batch_size=4, max_seq_len=4096, kv_cache_gb=0.25)
    assert runner.kv.data_ptr() % hugepages.HUGE == 0 and not runner.kv.any()
