"""Batched drafting and the device-side greedy walk: the same trees as drafting one row at a time, the
same verification as the host walk, and at most three host reads per engine step at batch 8."""

import copy

import pytest
import torch
from torch.overrides import TorchFunctionMode

from draftheads.inference.engine import Engine, EngineConfig
from draftheads.inference.proposers.eagle import EagleProposer
from draftheads.inference.proposers.eagle3 import Eagle3Proposer
from draftheads.inference.proposers.medusa import MedusaProposer
from draftheads.inference.sampling import SamplingParams
from draftheads.inference.tree import Node, Tree, TreeSpec, select_nodes, select_tree
from draftheads.inference.verify import NodeLogits, _greedy_walk, device_greedy, greedy_walk, verify_greedy
from draftheads.testing import random_heads

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 5, 6, 7], [20, 21, 22], [30, 31, 32, 33, 34, 35, 36, 37], [100, 101, 102],
           [3, 4], [40, 41, 42, 43, 44, 45], [60, 61, 62, 63], [70, 7, 70, 7, 70]]
PROPOSERS = {"eagle3": Eagle3Proposer, "eagle3_deep": Eagle3Proposer, "eagle": EagleProposer}


@pytest.fixture(scope="module")
def model(tiny_target):
    return tiny_target.model


@pytest.fixture(scope="module")
def model64(model):
    """In float64, so that batching cannot reorder near-tied candidates by rounding."""
    return copy.deepcopy(model).double()


def _trees_after_prefill(model, head, cls, prompts, tree, batched):
    """Drafts for every prompt after a prefill, in one batch or one row at a time (fresh proposers);
    ``batched`` may also be a function (proposer, states, tree) -> trees."""
    proposer = cls(head, model)
    engine = Engine(model, proposer=proposer, tree=tree)
    states = [engine.request_state(i, p, SamplingParams()) for i, p in enumerate(prompts)]
    with torch.no_grad():
        for st in states:
            out = model(torch.tensor([st.tokens]), output_hidden_states=True)
            st.tokens.append(int(out.logits[0, -1].argmax()))
            proposer.start(st, {i: out.hidden_states[i][0] for i in proposer.layer_ids})
    if callable(batched):
        return batched(proposer, states, tree)
    if batched:
        return proposer.propose_batch(states, tree)
    return [proposer.propose(st, tree) for st in states]


@pytest.mark.parametrize("name", list(PROPOSERS))
@pytest.mark.parametrize("tree", [TreeSpec(depth=4, top_k=3, total_tokens=12), TreeSpec(depth=5, top_k=1, total_tokens=6),
                                  TreeSpec(depth=1, top_k=4, total_tokens=4)])
def test_batched_trees_equal_per_row_trees(model64, name, tree):
    model = model64
    head = random_heads(model)[name].double()
    prompts = PROMPTS[:5]
    batched = _trees_after_prefill(model, head, PROPOSERS[name], prompts, tree, batched=True)
    alone = _trees_after_prefill(model, head, PROPOSERS[name], prompts, tree, batched=False)
    for a, b in zip(batched, alone):
        assert (a.tokens, a.parents) == (b.tokens, b.parents)
        assert len(a) == tree.total_tokens and a.depth <= tree.depth


def test_prompts_of_unequal_lengths_catch_up_in_groups_and_draft_as_one_row_at_a_time(model64, monkeypatch):
    """A long prompt does not pad the short ones: the first draft reads the prompts in forwards grouped by
    length, and the trees are those drafted one row at a time."""
    from draftheads.inference.proposers import draft_tree

    head = random_heads(model64)["eagle3"].double()
    prompts = [list(range(5, 125)), [20, 21, 22], [30, 31, 32, 33], [100, 101, 102], list(range(10, 120))]
    tree = TreeSpec(depth=4, top_k=3, total_tokens=12)
    forwards = []
    rows_of = draft_tree.DraftTreeProposer._catch_up_rows
    monkeypatch.setattr(draft_tree.DraftTreeProposer, "_catch_up_rows",
                        lambda self, states, feats: forwards.append(sorted(st.rid for st in states))
                        or rows_of(self, states, feats))
    batched = _trees_after_prefill(model64, head, Eagle3Proposer, prompts, tree, batched=True)
    assert forwards == [[1, 2, 3], [0, 4]]
    forwards.clear()
    alone = _trees_after_prefill(model64, head, Eagle3Proposer, prompts, tree, batched=False)
    assert len(forwards) == len(prompts)
    for a, b in zip(batched, alone):
        assert (a.tokens, a.parents) == (b.tokens, b.parents)


def test_length_groups_split_at_the_least_padded_cost():
    """The grouping is the cheapest of every partition of the rows (brute force over small cases)."""
    import random

    from draftheads.inference.proposers.draft_tree import length_groups

    def cost(groups, sizes, overhead):
        return sum(overhead + len(g) * max(sizes[i] for i in g) for g in groups)

    def partitions(items):
        if not items:
            yield []
            return
        first, rest = items[0], items[1:]
        for p in partitions(rest):
            yield [[first], *p]
            for i in range(len(p)):
                yield [*p[:i], [first, *p[i]], *p[i + 1:]]

    rng = random.Random(0)
    for _ in range(40):
        sizes = [rng.randint(1, 200) for _ in range(rng.randint(1, 7))]
        overhead = rng.choice([0, 8, 32, 500])
        groups = length_groups(sizes, overhead)
        assert sorted(i for g in groups for i in g) == list(range(len(sizes)))
        assert cost(groups, sizes, overhead) == min(cost(p, sizes, overhead) for p in partitions(list(range(len(sizes)))))
    assert length_groups([45, 71, 60, 185, 48, 37], 10 ** 6) == [[5, 0, 4, 2, 1, 3]]  # one forward when launches dominate


@pytest.mark.parametrize("name", ["dflash", "dspark"])
def test_block_chains_of_a_batch_equal_the_top_k_walk_per_row(model64, name):
    """Greedy chains decoded for the whole batch at once (one projection, one read-back) give what the
    general top-k walk gives at k = 1 for each request alone, with DSpark's Markov bias and its
    confidence cut."""
    from draftheads.inference.projection import vocab_logits
    from draftheads.inference.proposers.dflash import DFlashProposer
    from draftheads.inference.proposers.dspark import DSparkProposer

    cls = {"dflash": DFlashProposer, "dspark": DSparkProposer}[name]
    head = random_heads(model64)[name].double()
    chain = TreeSpec(depth=3, top_k=1, total_tokens=4)

    @torch.no_grad()
    def walk(proposer, states, tree):
        out = []
        for st in states:
            h = proposer.block_hidden(st)[: tree.depth]
            out.append(proposer._tree(st, h, vocab_logits(h, proposer.weight).float(), tree))
        return out
    batched = _trees_after_prefill(model64, head, cls, PROMPTS, chain, batched=True)
    alone = _trees_after_prefill(model64, head, cls, PROMPTS, chain, batched=walk)
    assert [(a.tokens, a.parents) for a in batched] == [(b.tokens, b.parents) for b in alone]
    lengths = {len(t) for t in batched}
    assert lengths == {4} if name == "dflash" else len(lengths) > 1  # the random confidence head cuts some


def test_select_nodes_ranks_by_score_then_depth_and_keeps_parents_first():
    # pool: 0,1 children of the root; 2,3 children of 0; 4 child of 1 (tied with its parent)
    pool = [Node(10, -1, 1, -0.1), Node(11, -1, 1, -0.5), Node(12, 0, 2, -0.3), Node(13, 0, 2, -0.9),
            Node(14, 1, 2, -0.5)]
    tree = select_tree(99, pool, 5, lambda ids: ids)
    # best four: 0 (-0.1), 2 (-0.3), then 1 and 4 tie at -0.5 and the shallower comes first
    assert tree.tokens == [99, 10, 11, 12, 14] and tree.parents == [-1, 0, 0, 1, 2]
    scores = torch.tensor([[nd.score for nd in pool]] * 2)
    nodes, parents = select_nodes(scores, torch.tensor([[1, 1, 2, 2, 2]] * 2), torch.tensor([[-1, -1, 0, 0, 1]] * 2), 2)
    assert nodes.tolist() == [[0, 2]] * 2 and parents.tolist() == [[0, 1]] * 2


#        0 (root)
#      /   \
#     1:a   2:b
#    / \      \
#   3:c 4:d    5:e
TOKENS = [9, 1, 2, 3, 4, 5]
PARENTS = [-1, 0, 0, 1, 1, 2]


@pytest.mark.parametrize("argmax", [[1, 4, 7, 7, 6, 7], [2, 0, 5, 7, 7, 8], [7, 4, 5, 0, 0, 0], [1, 8, 0, 0, 0, 0]])
def test_tensor_greedy_walk_equals_verify_greedy(argmax):
    want = verify_greedy(Tree(TOKENS, PARENTS), argmax)
    acc, count = greedy_walk(torch.tensor([TOKENS]), torch.tensor([PARENTS]), torch.tensor([argmax]), depth=2)
    assert acc[0, : int(count[0])].tolist() == want.accepted


def test_device_walk_equals_host_walk_on_random_trees():
    gen = torch.Generator().manual_seed(0)
    vocab, hidden = 7, 5
    trees = []
    for size in (1, 2, 6, 13, 9):
        parents = [-1] + [int(torch.randint(i, (1,), generator=gen)) for i in range(1, size)]
        trees.append(Tree(torch.randint(vocab, (size,), generator=gen).tolist(), parents))
    offs = [0, 1, 3, 9, 22]
    h = torch.randn(31, hidden, generator=gen)
    w = torch.randn(vocab, hidden, generator=gen)
    want = _greedy_walk(trees, NodeLogits(h, w), offs)
    got = device_greedy(trees, NodeLogits(h, w), offs)
    assert [(r.accepted, r.tokens) for r in got] == [(r.accepted, r.tokens) for r in want]
    assert sum(len(r.accepted) for r in want) > 0  # the trees were walked past their roots


# ------------------------------------------------------------------ host reads per engine step

READS = {"item", "tolist", "__int__", "__float__", "__bool__", "__index__", "cpu", "numpy", "nonzero"}


class HostReads(TorchFunctionMode):
    """Counts every call that reads a tensor's values on the host (a device sync off the CPU): ``.item()``,
    ``.tolist()``, ``int()``/``float()``/``bool()``, use as an index, ``.cpu()``, ``.numpy()``, ``nonzero``
    and boolean-mask indexing (its shape depends on the values)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in READS:
            self.count += 1
        elif name == "__getitem__":
            idx = args[1] if isinstance(args[1], tuple) else (args[1],)
            self.count += any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in idx)
        return func(*args, **(kwargs or {}))


def _reads_per_step(model, proposer, batch, tree="small", **config):
    engine = Engine(model, proposer=proposer, tree=tree, config=EngineConfig(verify_on_device=True, **config))
    prompts = (PROMPTS * 2)[:batch]
    reads, steps = HostReads(), []
    forward = engine.forward

    def counted_forward(*a, **k):  # a step runs propose -> forward -> verify -> commit -> observe
        steps.append(reads.count)
        return forward(*a, **k)

    engine.forward = counted_forward
    with reads:
        outs = engine.generate(prompts, SamplingParams(max_new_tokens=12, stop_at_eos=False))
    bounds = steps[1:] + [reads.count]  # per forward: reads from its step's start to the next step's start
    per_step = [b - a for a, b in zip(steps[1:], bounds[1:])]  # engine steps after the prefill
    return per_step, outs


@pytest.mark.parametrize("tree", ["small", "auto"])
def test_at_most_three_host_reads_per_engine_step_at_batch_8(model, tree):
    head = random_heads(model)["eagle3"]
    per_step, outs = _reads_per_step(model, Eagle3Proposer(head, model), batch=8, tree=tree)
    assert len(per_step) >= 3 and all(len(o.token_ids) == 12 for o in outs)
    # auto reads each drafted depth's scores to decide whether to draft the next
    assert max(per_step) <= (3 if tree != "auto" else 3 + Eagle3Proposer.auto_pool.depth - 1), per_step
    # the counter sees reads: Medusa drafts row by row and reads each row's candidates back
    rowwise, _ = _reads_per_step(model, MedusaProposer(random_heads(model)["medusa"], model), batch=8)
    assert max(rowwise) > 3, rowwise
