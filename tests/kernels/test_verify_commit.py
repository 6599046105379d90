import pytest
import torch

from draftheads.inference.kv_cache import PagedKVCache
from draftheads.inference.tree import Tree
from draftheads.inference.verify import verify_greedy
from draftheads.kernels.verify import (
    commit_kv_layers,
    commit_kv_layers_ref,
    greedy_verify,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _random_trees(rows, seed):
    g = torch.Generator().manual_seed(seed)
    trees, argmaxes = [], []
    for r in range(rows):
        n = [1, 7, 13][r % 3]
        parents = [-1] + [int(torch.randint(i, (1,), generator=g)) for i in range(1, n)]
        tokens = torch.randint(0, 4, (n,), generator=g).tolist()  # small vocab: many matches
        trees.append(Tree(tokens, parents))
        kids = trees[-1].children()
        # the target's argmax follows a random child most of the time, so walks go deep
        argmaxes.append([tokens[kids[i][int(torch.randint(len(kids[i]), (1,), generator=g))]]
                         if kids[i] and torch.rand((), generator=g) < 0.8 else int(torch.randint(0, 4, (1,), generator=g))
                         for i in range(n)])
    return trees, argmaxes


def test_greedy_verify_kernel_matches_verify_py():
    trees, argmaxes = _random_trees(9, 0)
    width = max(len(t) for t in trees)
    pad = lambda xs, v: xs + [v] * (width - len(xs))  # noqa: E731
    tokens = torch.tensor([pad(t.tokens, -1) for t in trees], dtype=torch.int32)
    parents = torch.tensor([pad(t.parents, -2) for t in trees], dtype=torch.int32)
    argmax = torch.tensor([pad(a, -1) for a in argmaxes], dtype=torch.int32)
    sizes = torch.tensor([len(t) for t in trees], dtype=torch.int32)
    out, count = greedy_verify(tokens.to(DEVICE), parents.to(DEVICE), argmax.to(DEVICE), sizes.to(DEVICE))
    for r, (t, a) in enumerate(zip(trees, argmaxes)):
        want = verify_greedy(t, a).accepted
        assert int(count[r]) == len(want) and out[r, : count[r]].tolist() == want, (r, want)
        assert (out[r, count[r]:] == -1).all()  # -1 past the walk
    assert count.max() > 1  # the case exercises multi-level walks


def test_commit_kernel_matches_reference_with_overlapping_moves():
    kv = torch.randn(2, 40, 2, 16, device=DEVICE)
    # row A keeps nodes [0, 2, 3] of a tree at slots 10..; row B keeps [0, 1, 5] at slots 30..
    src = torch.tensor([12, 13, 35], device=DEVICE)
    dst = torch.tensor([11, 12, 32], device=DEVICE)
    want = kv.clone()
    one_row = torch.tensor([0, src.numel()], device=DEVICE)  # every move in order, in one program
    commit_kv_layers_ref(want[None], src, dst)
    commit_kv_layers(kv[None], src, dst, one_row)
    torch.testing.assert_close(kv, want, rtol=0, atol=0)


def _moves(rows):
    """(src, dst, row_start) of rows given as (first slot, accepted nodes): node a moves to slot first + d."""
    src, dst, starts = [], [], [0]
    for first, accepted in rows:
        for d, a in enumerate(accepted):
            if a != d:
                src.append(first + a)
                dst.append(first + d)
        starts.append(len(src))
    return (torch.tensor(src, dtype=torch.long, device=DEVICE), torch.tensor(dst, dtype=torch.long, device=DEVICE),
            torch.tensor(starts, dtype=torch.long, device=DEVICE))


def _in_order(kv, src, dst):
    """The moves one after another, as the kernel runs a row's moves."""
    for s, d in zip(src.tolist(), dst.tolist()):
        kv[:, :, d] = kv[:, :, s]


def _assert_same(got, want, what):
    bad = (got != want).nonzero()
    assert not len(bad), f"{what}: {len(bad)} elements differ, first (layer, half, slot, head, dim) {bad[:8].tolist()}"


def test_commit_all_layers_in_one_launch_matches_reference():
    # row A: accepted [0, 2, 3, 5] at slots 10..: 12->11, 13->12 (12 is the previous move's source), 15->13;
    # row B: nothing to move; row C: [0, 1, 4] at slots 30..: 34->32; row D: [0, 7] at slot 50: 57->51
    rows = [(10, [0, 2, 3, 5]), (20, [0, 1, 2]), (30, [0, 1, 4]), (50, [0, 7]), (60, [0])]
    src, dst, starts = _moves(rows)
    assert starts.tolist() == [0, 3, 3, 4, 5, 5]
    kv = torch.randn(3, 2, 64, 2, 5, device=DEVICE)  # head_dim 5: a slot of 10 elements, not a power of two
    before, want, seq = kv.clone(), kv.clone(), kv.clone()
    commit_kv_layers_ref(want, src, dst, starts)
    _in_order(seq, src, dst)
    _assert_same(seq, want, "in-order moves vs gather-then-scatter")
    commit_kv_layers(kv, src, dst, starts)
    _assert_same(kv, want, "kernel vs reference")
    for first, accepted in rows:  # each accepted node's original K/V, on every layer and both halves
        _assert_same(kv[:, :, first: first + len(accepted)], before[:, :, [first + a for a in accepted]], f"row at {first}")


def test_commit_kernel_keeps_sources_that_later_moves_overwrite():
    """Move 12->11, then 13->12 overwrites slot 12 after it was read: the result holds nodes 2 and 3."""
    kv = torch.arange(2 * 20, dtype=torch.float32, device=DEVICE).view(1, 2, 20, 1, 1).clone()
    src, dst, starts = _moves([(10, [0, 2, 3])])
    commit_kv_layers(kv, src, dst, starts)
    assert kv[0, 0, 10:13].flatten().tolist() == [10.0, 12.0, 13.0]
    assert kv[0, 1, 10:13].flatten().tolist() == [30.0, 32.0, 33.0]


def _filled_cache(use_triton, trees, seed=0):
    g = torch.Generator().manual_seed(seed)
    cache = PagedKVCache(num_layers=3, num_blocks=24, kv_heads=2, head_dim=3, block_size=4, device=DEVICE,
                         use_triton=use_triton)
    for sid, (prompt, tree) in enumerate(trees):
        cache.add(sid)
        cache.reserve(sid, prompt)
        cache.truncate(sid, prompt)
        cache.reserve(sid, tree)
        slots = cache.slots(sid, 0, prompt + tree)
        for layer in range(3):
            k, v = torch.randn(2, prompt + tree, 2, 3, generator=g).to(DEVICE)
            cache.write(layer, slots, k, v)
    return cache


def test_commit_many_triton_matches_torch_and_per_row_commits():
    trees = [(5, 6), (3, 4), (0, 9), (7, 1)]  # (committed length, tree tokens written after it)
    items = [(0, [0, 2, 3, 5]), (1, [0, 1, 2]), (2, [0, 4, 5, 8]), (3, [0])]
    caches = {name: _filled_cache(t, trees) for name, t in (("torch", False), ("triton", True), ("rows", False))}
    before = caches["torch"].storage.clone()
    caches["torch"].commit_many(items)
    caches["triton"].commit_many(items)
    for sid, accepted in items:
        caches["rows"].commit(sid, accepted)
    _assert_same(caches["triton"].storage, caches["torch"].storage, "triton vs torch commit_many")
    _assert_same(caches["rows"].storage, caches["torch"].storage, "per-row commits vs commit_many")
    ref = caches["torch"]
    for (sid, accepted), (prompt, _) in zip(items, trees):
        assert ref.length(sid) == prompt + len(accepted)
        assert caches["triton"].length(sid) == ref.length(sid)
        kept = [prompt + a for a in accepted]
        old_slots = _filled_cache(False, trees).slots(sid, 0, prompt + max(accepted) + 1)
        for layer in range(3):
            got = ref.gather_kv(layer, ref.slots(sid, 0, ref.length(sid)))
            want = before[layer].view(2, -1, 2, 3)[:, old_slots[list(range(prompt)) + kept]]
            _assert_same(got, want, f"sequence {sid} layer {layer}")
    assert caches["triton"].free_blocks() == ref.free_blocks()


def test_commit_many_rejects_bad_items_before_moving_anything():
    cache = _filled_cache(False, [(2, 4), (1, 3)])
    before = cache.storage.clone()
    with pytest.raises(ValueError, match="must start at the root"):
        cache.commit_many([(0, [0, 2]), (1, [0, 2, 1])])
    with pytest.raises(ValueError, match="appears twice"):
        cache.commit_many([(0, [0, 2]), (0, [0, 1])])
    assert torch.equal(cache.storage, before) and cache.length(0) == 2


def test_layer_views_share_one_storage():
    cache = PagedKVCache(num_layers=2, num_blocks=3, kv_heads=1, head_dim=2, block_size=2, device=DEVICE)
    cache.add(0)
    cache.reserve(0, 2)
    cache.write(1, cache.slots(0, 0, 2), torch.ones(2, 1, 2, device=DEVICE), 2 * torch.ones(2, 1, 2, device=DEVICE))
    blk = cache.block_table(0)[0]
    assert cache.storage[1, 0, blk].eq(1).all() and cache.storage[1, 1, blk].eq(2).all()
    assert cache.k[1].data_ptr() == cache.storage[1, 0].data_ptr() and cache.storage[0].eq(0).all()


def test_sampled_verify_kernel_matches_verify_py_for_same_uniforms():
    from draftheads.inference.verify import verify_sampled_uniforms
    from draftheads.kernels.verify import sampled_verify

    g = torch.Generator().manual_seed(5)
    trees, _ = _random_trees(12, 1)
    vocab = 37  # odd, spans several scan blocks only if BLOCK_V < V; keep it small for the interpreter
    probs = [torch.softmax(torch.randn(len(t), vocab, generator=g) * 2, -1) for t in trees]
    for t, p in zip(trees, probs):  # make drafted children likely so walks go deep
        for i, par in enumerate(t.parents[1:], 1):
            p[par, t.tokens[i]] += 2.0
        p /= p.sum(-1, keepdim=True)
    width = max(len(t) for t in trees)
    pad = lambda xs, v: xs + [v] * (width - len(xs))  # noqa: E731
    tokens = torch.tensor([pad(t.tokens, -1) for t in trees], dtype=torch.int32)
    parents = torch.tensor([pad(t.parents, -2) for t in trees], dtype=torch.int32)
    uniforms = torch.rand(len(trees), width, generator=g)
    starts = torch.tensor([0] + [len(t) for t in trees[:-1]], dtype=torch.int32).cumsum(0).to(torch.int32)
    sizes = torch.tensor([len(t) for t in trees], dtype=torch.int32)
    out, count, bonus = sampled_verify(tokens.to(DEVICE), parents.to(DEVICE), torch.cat(probs).to(DEVICE),
                                       starts.to(DEVICE), sizes.to(DEVICE), uniforms.to(DEVICE))
    deep = 0
    for r, (t, p) in enumerate(zip(trees, probs)):
        want = verify_sampled_uniforms(t, p, uniforms[r].tolist())
        got = out[r, : count[r]].tolist()
        assert got == want.accepted, (r, got, want.accepted)
        assert int(bonus[r]) == want.tokens[-1]
        deep = max(deep, len(got))
    assert deep >= 2, [verify_sampled_uniforms(t, p, uniforms[r].tolist()) for r, (t, p) in enumerate(zip(trees, probs))]
