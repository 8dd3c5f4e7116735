"""Rules of the tile table (cupyflash._config) that no kernel run shows: which tile each
device's shared memory gets."""
from cupyflash import _config


def test_double_buffered_forward_tile_only_where_two_blocks_fit():
    for limit in _config.SMEM_LIMIT.values():
        for hd in _config.HEAD_DIM_BUCKETS:
            t = _config.tile("fwd", hd, limit)
            assert t.smem_bytes(hd) * t.stages <= limit, (limit, hd, t)
            assert t.stages_for(causal=True) == 1
            assert t.smem_bytes(hd, causal=True) <= t.smem_bytes(hd)
    # d=64: two K/V buffers on sm_80 and sm_90; on 99 KB parts (sm_86/89) one, which keeps
    # two blocks per SM.
    assert _config.tile("fwd", 64, _config.SMEM_LIMIT[90]).stages == 2
    assert _config.tile("fwd", 64, _config.SMEM_LIMIT[80]).stages == 2
    assert _config.tile("fwd", 64, _config.SMEM_LIMIT[89]).stages == 1
