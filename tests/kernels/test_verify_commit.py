import torch

from draftheads.inference.tree import Tree
from draftheads.inference.verify import verify_greedy
from draftheads.kernels.verify import commit_kv, commit_kv_ref, greedy_verify, greedy_verify_ref

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
    ref_out, ref_count = greedy_verify_ref(tokens, parents, argmax, sizes)
    assert torch.equal(count.cpu(), ref_count) and torch.equal(out.cpu(), ref_out)
    for r, (t, a) in enumerate(zip(trees, argmaxes)):
        want = verify_greedy(t, a).accepted
        assert out[r, : count[r]].tolist() == want, (r, want)
    assert count.max() > 1  # the case exercises multi-level walks


def test_commit_kernel_matches_reference_with_overlapping_moves():
    kv = torch.randn(2, 40, 2, 16, device=DEVICE)
    # row A keeps nodes [0, 2, 3] of a tree at slots 10..; row B keeps [0, 1, 5] at slots 30..
    src = torch.tensor([12, 13, 35], device=DEVICE)
    dst = torch.tensor([11, 12, 32], device=DEVICE)
    want = kv.clone()
    commit_kv_ref(want, src, dst)
    commit_kv(kv, src, dst)
    torch.testing.assert_close(kv, want, rtol=0, atol=0)


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
