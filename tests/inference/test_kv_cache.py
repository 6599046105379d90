import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from draftheads.inference.kv_cache import BlocksExhausted, PagedKVCache


def _kv(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 2, 4, generator=g), torch.randn(n, 2, 4, generator=g)


ops = st.lists(
    st.tuples(st.sampled_from(["append", "tree", "free", "new"]), st.integers(0, 3), st.integers(1, 9),
              st.lists(st.booleans(), min_size=9, max_size=9)),
    min_size=1, max_size=40,
)


@settings(max_examples=60, deadline=None)
@given(ops)
def test_random_ops_match_contiguous_reference(program):
    cache = PagedKVCache(num_layers=2, num_blocks=40, kv_heads=2, head_dim=4, block_size=4)
    ref: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    next_id, seed = 0, 0
    for op, which, n, keep in program:
        seed += 1
        ids = sorted(ref)
        if op == "new" or not ids:
            cache.add(next_id)
            ref[next_id] = [[], []]
            next_id += 1
            continue
        sid = ids[which % len(ids)]
        if op == "free":
            cache.release(sid)
            del ref[sid]
            continue
        start = cache.length(sid)
        try:
            cache.reserve(sid, n)
        except BlocksExhausted:
            continue
        slots = cache.slots(sid, start, n)
        per_layer = [_kv(n, seed * 10 + layer) for layer in range(2)]
        for layer, (k, v) in enumerate(per_layer):
            cache.write(layer, slots, k, v)
        if op == "append":
            accepted = list(range(n))
        else:  # a tree: keep the root and an increasing subset of the other nodes
            accepted = [0] + [i for i in range(1, n) if keep[i]]
        cache.commit(sid, accepted)
        for layer, (k, v) in enumerate(per_layer):
            ref[sid][layer].append((k[accepted], v[accepted]))
    used = 0
    for sid, layers in ref.items():
        length = cache.length(sid)
        used += -(-length // 4)
        for layer in range(2):
            want_k = torch.cat([k for k, _ in layers[layer]]) if layers[layer] else torch.zeros(0, 2, 4)
            want_v = torch.cat([v for _, v in layers[layer]]) if layers[layer] else torch.zeros(0, 2, 4)
            assert want_k.shape[0] == length
            k, v = cache.gather(layer, cache.slots(sid, 0, length))
            torch.testing.assert_close(k, want_k, rtol=0, atol=0)
            torch.testing.assert_close(v, want_v, rtol=0, atol=0)
    assert cache.free_blocks() == 40 - used  # no leaked or double-freed blocks


def test_exhausted_blocks_are_a_clear_error_and_neighbours_survive():
    cache = PagedKVCache(num_layers=1, num_blocks=3, kv_heads=1, head_dim=2, block_size=2)
    cache.add(0)
    cache.add(1)
    cache.reserve(0, 4)
    slots = cache.slots(0, 0, 4)
    k = torch.arange(8.0).view(4, 1, 2)
    cache.write(0, slots, k, k)
    cache.commit(0, [0, 1, 2, 3])
    with pytest.raises(BlocksExhausted, match="KV cache exhausted: sequence 1 needs 2 more blocks"):
        cache.reserve(1, 3)
    torch.testing.assert_close(cache.gather(0, cache.slots(0, 0, 4))[0], k)


def test_commit_moves_accepted_nodes_into_place():
    cache = PagedKVCache(num_layers=1, num_blocks=4, kv_heads=1, head_dim=1, block_size=2)
    cache.add(7)
    cache.reserve(7, 6)
    vals = torch.tensor([10.0, 11, 12, 13, 14, 15]).view(6, 1, 1)
    cache.write(0, cache.slots(7, 0, 6), vals, vals)
    cache.commit(7, [0, 2, 5])
    assert cache.length(7) == 3
    assert cache.gather(0, cache.slots(7, 0, 3))[0].flatten().tolist() == [10.0, 12.0, 15.0]
    assert cache.free_blocks() == 2
