import pytest
import torch

from draftheads.inference.engine import Engine
from draftheads.inference.proposers.eagle3 import Eagle3Proposer
from draftheads.inference.replay import WalkText, capture, row_texts, walk
from draftheads.inference.sampling import SamplingParams
from draftheads.inference.tree import Tree, chain_parents, parse_tree
from draftheads.metrics import SpecMetrics
from draftheads.testing import OracleProposer, random_heads

PROMPTS = [[5, 6, 7, 8, 5, 6, 7], [9, 10, 11], [12, 13, 14, 15, 16]]


class _Flawed(OracleProposer):
    """The target's greedy continuation with a wrong token wherever (position + depth) % 3 == 0: drafts
    accepted to every length, the same wherever they are drafted from."""

    @torch.no_grad()
    def propose(self, st, tree=None):
        good = super().propose(st).tokens[1:]
        pos = len(st.tokens)
        tokens = [t if (pos + d) % 3 else (t + 1) % 50 for d, t in enumerate(good)]
        return Tree([st.root, *tokens], chain_parents(len(tokens)))


def _engine_metrics(model, proposer, tree, limit):
    engine = Engine(model, proposer=proposer, tree=tree)
    outs = engine.generate(PROMPTS, SamplingParams(max_new_tokens=limit, stop_at_eos=False))
    return outs, [o.metrics for o in outs]


def _same(a: SpecMetrics, b: SpecMetrics):
    assert (a.drafts, a.accepted, a.accepted_per_pos, a.drafts_per_pos, a.draft_tokens) == (
        b.drafts, b.accepted, b.accepted_per_pos, b.drafts_per_pos, b.draft_tokens)


def _greedy(model, limit, overhang=6):
    return Engine(model).generate(PROMPTS, SamplingParams(max_new_tokens=limit + overhang, stop_at_eos=False))


def test_the_walk_counts_what_the_engine_counts_for_a_drafter_right_at_every_length(tiny_target):
    model, limit = tiny_target.model, 24
    texts = [WalkText(p, list(o.token_ids), limit) for p, o in zip(PROMPTS, _greedy(model, limit))]
    proposer = _Flawed(model, 4)
    _, want = _engine_metrics(model, proposer, "chain4", limit)
    got = walk(proposer, texts, [{} for _ in texts], parse_tree("chain4"), rows=2)
    for a, b in zip(got, want):
        _same(a, b)
    total = SpecMetrics()
    for m in got:
        total = total.merge(m)
    assert 1.5 < total.tau < 4.5 and total.alpha[0] > 0.4  # drafts of every accepted length were walked


@pytest.mark.parametrize("mode", ["chain3", "small"])
def test_the_walk_of_an_eagle3_head_is_the_engines_eval(tiny_target, mode):
    model, limit = tiny_target.model, 20
    head = random_heads(model)["eagle3"]
    with torch.no_grad():  # a head that agrees with the target some of the time: its lm_head is the target's
        head.lm_head.weight.copy_(model.get_output_embeddings().weight[head.d2t + torch.arange(len(head.d2t))])
    proposer = Eagle3Proposer(head, model)
    outs, want = _engine_metrics(model, proposer, mode, limit)
    texts = [WalkText(p, list(o.token_ids), limit) for p, o in zip(PROMPTS, _greedy(model, limit))]
    assert [t.answer[:limit] for t in texts] == [o.token_ids for o in outs]  # greedy speculation is exact
    got = walk(proposer, texts, capture(model, texts, proposer.layer_ids), parse_tree(mode))
    for a, b in zip(got, want):
        _same(a, b)
    assert sum(m.drafts for m in got) > len(PROMPTS) and sum(m.accepted for m in got) > 0


def test_row_texts_are_the_answers_of_each_document_with_their_hidden_states():
    # two rows: row 0 packs doc 0 (prompt 3, answer 3, prompt 1, answer 2) and doc 1 (prompt 2, answer 2); row 1
    # holds doc 2 (an answer at its first token, which has no prompt to draft from) and padding
    ids = torch.arange(100, 124).view(2, 12)
    mask = torch.tensor([[0, 0, 0, 1, 1, 1, 0, 1, 1, 0, 0, 1], [1, 1, 0, 0, 1, 1, 1, 0, 0, 0, 0, 0]])
    docs = torch.tensor([[0] * 9 + [1] * 3, [2] * 7 + [-1] * 5])
    feats = {3: torch.arange(24.0).view(2, 12, 1)}
    batch = {"input_ids": ids, "loss_mask": mask, "doc_ids": docs}
    texts, hidden = row_texts(batch, feats, limit=2, most=10)
    got = [(t.prompt, t.answer, t.limit) for t in texts]
    assert got == [([100, 101, 102], [103, 104, 105], 2),
                   ([100, 101, 102, 103, 104, 105, 106], [107, 108], 2),
                   ([109, 110], [111], 1),
                   ([112, 113, 114, 115], [116, 117, 118], 2)]
    assert [h[3].flatten().tolist() for h in hidden][1] == [float(x) for x in range(9)]
    assert [h[3].flatten().tolist() for h in hidden][3] == [float(x) for x in range(12, 19)]
    assert len(row_texts(batch, feats, limit=2, most=2)[0]) == 2
