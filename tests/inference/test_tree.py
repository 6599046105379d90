import json

import pytest

from draftheads.errors import DraftheadsError
from draftheads.inference.tree import (
    Tree,
    TreeSpec,
    ancestor_mask,
    depths,
    expected_accept_length,
    greedy_shape,
    parse_tree,
    position_ids,
    retrieve_paths,
    shape_from_paths,
)

#        0
#      /   \
#     1     2
#    / \     \
#   3   4     5
PARENTS = [-1, 0, 0, 1, 1, 2]


def test_depths_positions_paths():
    assert depths(PARENTS) == [0, 1, 1, 2, 2, 2]
    assert position_ids(PARENTS, 10).tolist() == [10, 11, 11, 12, 12, 12]
    assert retrieve_paths(PARENTS) == [[0, 1, 3], [0, 1, 4], [0, 2, 5]]


def test_ancestor_mask_by_hand():
    m = ancestor_mask(PARENTS).int().tolist()
    assert m == [
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 0, 1, 0, 0, 0],
        [1, 1, 0, 1, 0, 0],
        [1, 1, 0, 0, 1, 0],
        [1, 0, 1, 0, 0, 1],
    ]


def test_shape_from_rank_paths_adds_prefixes():
    parents, order = shape_from_paths([[0, 1], [1], [0, 0, 0]])
    assert order == [(), (0,), (1,), (0, 0), (0, 1), (0, 0, 0)]
    assert parents == [-1, 0, 0, 1, 1, 3]


def test_greedy_shape_prefers_likely_nodes():
    acc = [[0.8, 0.1], [0.5, 0.05]]
    shape = greedy_shape(acc, 3)
    assert shape == [(0,), (0, 0), (1,)]
    assert expected_accept_length(shape, acc) == pytest.approx(1 + 0.8 + 0.4 + 0.1)


def test_bad_trees_and_files(tmp_path):
    with pytest.raises(DraftheadsError):
        Tree([1, 2], [0, 0])
    with pytest.raises(DraftheadsError):
        Tree([1, 2, 3], [-1, 2, 0])
    bad = tmp_path / "t.json"
    bad.write_text(json.dumps({"not": "a list"}))
    with pytest.raises(DraftheadsError, match="malformed"):
        parse_tree(str(bad))
    with pytest.raises(DraftheadsError, match="neither a named tree"):
        parse_tree("no-such-tree")
    good = tmp_path / "g.json"
    good.write_text("[[0], [1], [0, 0]]")
    assert parse_tree(str(good)).shape() == [(0,), (1,), (0, 0)]
    assert parse_tree(str(good)).shape(max_depth=2) == [(0,), (1,), (0, 0)]
    with pytest.raises(DraftheadsError, match="deep"):
        parse_tree(str(good)).shape(max_depth=1)  # a static tree deeper than the head is refused, not cut
    with pytest.raises(DraftheadsError, match="more than the 128"):
        parse_tree("chain100000")  # refused before any drafting


def test_one_name_is_one_tree_for_every_head():
    for name in ("chain3", "small", "medium", "large"):
        spec = parse_tree(name)
        assert len(spec.shape()) == spec.total_tokens - 1  # the static (Medusa) shape has the dynamic tree's size
        assert len(spec.shape(max_depth=3)) == spec.total_tokens - 1 if not spec.is_chain else 3
    assert parse_tree("chain3") == TreeSpec(depth=3, top_k=1, total_tokens=4, name="chain3")
