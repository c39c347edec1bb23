"""The values the kernel launchers take (``oscar.kernels.segments``, ``oscar.kernels.launch``): a bad field is
refused where the value is built, with a message naming the field, the value and what is valid; a launch value of
the wrong kernel family is refused by the launcher."""

from __future__ import annotations

import pytest
import torch

from oscar.cache.paged import PagedKVPool, decode_attention
from oscar.kernels.launch import MmaLaunch, QuantizeLaunch, RowsLaunch
from oscar.kernels.segments import HeadTransform, Segments

PT, IL = torch.zeros(2, 3, dtype=torch.int32), torch.zeros(2, dtype=torch.int32)
WIN = torch.zeros(2, 1, 4, 16)
LEN = torch.zeros(2, dtype=torch.int32)


@pytest.mark.parametrize("fields,message", [
    (dict(page_table=PT.float()), r"page_table must be an integer tensor \[B, pages\], got torch.float32"),
    (dict(int_len=IL[None]), r"int_len must be an integer tensor \[B\]"),
    (dict(sink_k=WIN, sink_v=WIN), "sink_k, sink_v and sink_len go together .* got only sink_k, sink_v"),
    (dict(recent_len=LEN), "recent_k, recent_v and recent_len go together .* got only recent_len"),
    (dict(recent_k=WIN, recent_v=WIN[:, :, :2], recent_len=LEN), r"must be \[B, Hkv, S, d\] of one shape"),
    (dict(sink_k=WIN, sink_v=WIN, sink_len=LEN.float()), r"sink_len must be an integer tensor \[B\]"),
    (dict(window_rows=torch.tensor([0.0, 1.0])), r"window_rows must be an integer tensor \[B\]"),
    (dict(int_pos0=-1), r"int_pos0=-1 must be a position >= 0"),
    (dict(int_pos0=True), r"int_pos0=True must be a position >= 0"),
])
def test_segments_refuse_bad_fields(fields, message):
    args = dict(page_table=PT, int_len=IL)
    args.update(fields)
    with pytest.raises(ValueError, match=message):
        Segments(**args)


def test_segments_list_the_windows_given():
    seg = Segments(PT, IL, recent_k=WIN, recent_v=WIN, recent_len=LEN, int_pos0=64)
    assert [w[0] for w in seg.windows] == ["recent"]
    seg = Segments(PT, IL, sink_k=WIN, sink_v=WIN, sink_len=LEN, recent_k=WIN, recent_v=WIN, recent_len=LEN)
    assert [w[0] for w in seg.windows] == ["sink", "recent"] and seg.windows[0][1] is WIN


@pytest.mark.parametrize("make,message", [
    (lambda: RowsLaunch(block_n=48), r"RowsLaunch\(block_n=48\) is not valid; block_n must be None or a power of two"),
    (lambda: RowsLaunch(num_splits=0), r"RowsLaunch\(num_splits=0\) is not valid"),
    (lambda: RowsLaunch(planes="yes"), r"RowsLaunch\(planes='yes'\) is not valid; planes must be None .* or a bool"),
    (lambda: RowsLaunch(warps=3), r"RowsLaunch\(warps=3\) is not valid; warps must be one of 1, 2, 4, 8, 16"),
    (lambda: RowsLaunch(maxnreg=8), r"RowsLaunch\(maxnreg=8\) is not valid"),
    (lambda: MmaLaunch(warps=16), r"MmaLaunch\(warps=16\) is not valid; warps must be one of 2, 4, 8"),
    (lambda: MmaLaunch(num_splits=300), r"MmaLaunch\(num_splits=300\) is not valid; num_splits must be None or an int "
                                        r"in \[1, 254\]"),
    (lambda: MmaLaunch(stages=7), r"MmaLaunch\(stages=7\) is not valid"),
    (lambda: MmaLaunch(min_blocks=0), r"MmaLaunch\(min_blocks=0\) is not valid"),
    (lambda: MmaLaunch(carveout=120), r"MmaLaunch\(carveout=120\) is not valid; carveout must be None or a percentage"),
    (lambda: MmaLaunch(rope_blocks=5), r"MmaLaunch\(rope_blocks=5\) is not valid; rope_blocks must be one of \(4, 8, "
                                       r"16, 32\)"),
    (lambda: QuantizeLaunch(block_t=12), r"QuantizeLaunch\(block_t=12\) is not valid"),
    (lambda: QuantizeLaunch(row_path=1), r"QuantizeLaunch\(row_path=1\) is not valid"),
])
def test_launch_values_refuse_bad_fields(make, message):
    with pytest.raises(ValueError, match=message):
        make()


@pytest.mark.parametrize("make,message", [
    (lambda: HeadTransform(R=torch.eye(8)), r"R must be \[Hkv, d, d\]"),
    (lambda: HeadTransform(mu=torch.zeros(8)), r"mu must be \[Hkv, d\]"),
    (lambda: HeadTransform(rho=torch.ones(2, 1)), r"rho must be \[Hkv\]"),
    (lambda: HeadTransform(rope_mu=torch.zeros(2, 8)), "need both rope_mu"),
    (lambda: HeadTransform(rope_mu=torch.zeros(2, 8), rope_freq=torch.ones(5)), "does not fit head_dim 8"),
])
def test_head_transform_refuses_bad_fields(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_a_launch_of_the_other_kernel_family_is_refused():
    """The launch value belongs to the kernel that reads the pages: row pages take ``RowsLaunch``."""
    pool = PagedKVPool(num_layers=1, num_kv_heads=1, head_dim=64, num_pages=2, max_batch=1, max_pages_per_seq=1,
                       group_size=64, page_size=16)
    pool.reserve([0], [3])
    q = torch.randn(1, 2, 64)
    with pytest.raises(ValueError, match=r"launch=MmaLaunch\(.*\) is not a RowsLaunch"):
        pool.attend(0, q, HeadTransform(), HeadTransform(), backend="triton", launch=MmaLaunch())
    with pytest.raises(ValueError, match="backend='banana' is not valid"):
        decode_attention(q, pool.k[0], pool.v[0], Segments(pool.page_table, pool.int_len), HeadTransform(),
                         HeadTransform(), backend="banana")
