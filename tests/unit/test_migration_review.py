"""Migration review: bad input at every public entry point, schedule stress, span accounting."""

import numpy as np
import pytest

from eplb import EplbError
from eplb import migration as mg

_OLD = np.array([[0, 1, 2, 0], [0, 1, 2, 2]])
_NEW = np.array([[1, 0, 2, 1], [2, 1, 0, 0]])
_LOAD = np.array([[3.0, 1.0, 1.0], [1.0, 1.0, 3.0]])
_OLD6 = np.tile(np.arange(6), (1, 2))                   # 6 GPUs x 2 slots, 6 experts
_NEW6 = np.roll(_OLD6, 3, axis=1)


# Relabelling and migrate ----------------------------------------------------------------------

@pytest.mark.parametrize("nodes", [4, 12, 0, -2, 1.5, True])
def test_relabel_refuses_nodes_that_do_not_split_the_gpus(nodes):
    """gpu_assignment fills only nodes x (G // nodes) columns of an uninitialised array: a bad
    node count must stop before it, not turn leftover memory into slot indices."""
    with pytest.raises(EplbError, match="nodes"):
        mg.relabel(_OLD6, _NEW6, 6, 6, nodes=nodes)
    with pytest.raises(EplbError, match="nodes"):
        mg.migrate(np.ones((1, 6)), _OLD6, _NEW6, 6, nodes=nodes)


@pytest.mark.parametrize("call, match", [
    (lambda: mg.relabel(_OLD, _NEW, 0, 3), "gpus must be"),
    (lambda: mg.relabel(_OLD[0], _NEW[0], 2, 3), r"\[layers, slots\]"),
    (lambda: mg.migrate(_LOAD[0], _OLD, _NEW, 2), "load must be"),
    (lambda: mg.migrate(_LOAD[:1], _OLD, _NEW, 2), "load must be"),
    (lambda: mg.migrate(np.full((2, 3), np.nan), _OLD, _NEW, 2), "finite"),
    (lambda: mg.migrate(_LOAD, _OLD, _NEW, 0), "gpus must be"),
    (lambda: mg.migrate(_LOAD, _OLD, np.array([[1, 0, 2, -1], [2, 1, 0, 0]]), 2), "target_LP"),
])
def test_relabel_and_migrate_name_bad_input(call, match):
    with pytest.raises(EplbError, match=match):
        call()


def test_migrate_keeps_a_permutation_of_the_target():
    """With a node count that splits the GPUs, the relabelled target is a slot permutation."""
    phy, perm, _ = mg.migrate(np.ones((1, 6)), _OLD6, _NEW6, 6, nodes=3)
    assert (np.sort(perm, axis=1) == np.arange(12)).all()
    assert np.array_equal(np.sort(phy, axis=1), np.sort(_NEW6, axis=1))
