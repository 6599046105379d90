import json

import pytest

from draftheads.errors import DraftheadsError
from draftheads.inference.tree import (
    Tree,
    ancestor_mask,
    depths,
    expected_accept_length,
    greedy_shape,
    load_shape,
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
        load_shape(str(bad))
    with pytest.raises(DraftheadsError, match="neither a named tree"):
        load_shape("no-such-tree")
    good = tmp_path / "g.json"
    good.write_text("[[0], [1], [0, 0]]")
    assert load_shape(str(good)) == [(0,), (1,), (0, 0)]
    assert len(load_shape("chain3")) == 3 and len(load_shape("large")) == 63
