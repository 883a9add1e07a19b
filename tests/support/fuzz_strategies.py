"""Hypothesis strategies shared by the fuzz tests (tests/fuzz/): extreme integers, valid
and weird keys, sessions, namespaces, ranks, inline section sizes, namespace layouts.
"""

from __future__ import annotations

from hypothesis import strategies as st

from kvdepot.v1 import depot_pb2 as pb
from tests.support.engine import make_key
from tests.support.fuzz_rig import MAX_JOB_KEYS, NS, NS1, U32


def extremes(lo: int, hi: int, small: int = 70) -> st.SearchStrategy[int]:
    return st.one_of(
        st.integers(lo, min(hi, small)),
        st.sampled_from(sorted({lo, hi, hi - 1, max(lo, 0), min(hi, 2**31)})),
        st.integers(lo, hi),
    )


valid_keys = st.builds(make_key, st.integers(0, 12), st.integers(0, 1))
weird_keys = st.one_of(
    st.just(b""),
    st.binary(max_size=4),
    st.binary(min_size=257, max_size=300),
    st.builds(make_key, st.integers(0, 5), st.sampled_from([2, 3, 64, U32])),
    st.binary(min_size=5, max_size=40),
)
any_key = st.one_of(valid_keys, valid_keys, weird_keys)
key_lists = st.one_of(
    st.lists(any_key, max_size=10),
    st.lists(valid_keys, max_size=6).map(lambda ks: ks + ks),  # duplicates
    st.integers(MAX_JOB_KEYS * 16 + 1, MAX_JOB_KEYS * 16 + 40).map(
        lambda n: [make_key(i, 0) for i in range(n)]
    ),  # too large a batch
)
sessions = st.one_of(
    st.just("HOME"), st.just("HOME"), st.sampled_from(["", "nope"]), st.text(max_size=40)
)
namespaces = st.one_of(
    st.sampled_from([NS, NS, NS1, "", "unknown-ns", "x" * 300]), st.text(max_size=40)
)
ranks = extremes(0, U32, small=4)
section_sizes = st.sampled_from([0, 1, 2047, 2048, 6143, 6144, 6145, 16383, 16384, 16385])


def layouts(ids: st.SearchStrategy[str] | None = None) -> st.SearchStrategy[pb.NamespaceLayout]:
    page = st.one_of(
        st.sampled_from([1024, 2048, 4096]), extremes(0, 2**31, small=8), st.just(2**30 + 1)
    )
    groups = st.one_of(
        st.lists(st.lists(page, min_size=0, max_size=4), min_size=0, max_size=3),
        st.just([[1024] * 4097]),  # too many layers
        st.just([[1024]] * 65),  # too many groups
        st.just([[4096, 4096], [1024, 1024, 1024]]),  # the fz layout itself
    )
    return st.builds(
        lambda i, w, b, g, d: pb.NamespaceLayout(
            id=i,
            world_size=w,
            blocks_per_chunk=b,
            groups=[pb.GroupLayout(layer_page_bytes=x) for x in g],
            description=d,
        ),
        ids
        or st.one_of(
            st.sampled_from([NS, NS1, "fzr-1", "fzr-2", "", "\x00bad", "y" * 129]),
            st.text(max_size=20),
        ),
        st.one_of(st.sampled_from([1, 2, 3]), extremes(0, U32, small=70)),
        st.one_of(st.sampled_from([1, 2]), extremes(0, U32, small=5000)),
        groups,
        st.text(max_size=20),
    )
