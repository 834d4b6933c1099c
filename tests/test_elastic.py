"""Horovod's elastic state objects in the core (aiacc.elastic), in one process: what commit, restore and sync
keep, and that ``run`` starts from the synchronised state. (A 2-rank sync of TensorFlow variables and a Keras
model: tests/workers/tf_horovod.py.)"""

from aiacc.elastic import ObjectState, run


class RankZeroSends:
    """A stand-in for broadcast_object on a rank other than 0: it receives rank 0's object."""

    def __init__(self, root_object):
        self.root_object = root_object
        self.calls = 0

    def __call__(self, obj):
        self.calls += 1
        assert set(obj) == set(self.root_object), obj  # every rank sends the same attributes
        return dict(self.root_object)


def test_object_state_commit_restore_and_sync():
    bcast = RankZeroSends({"epoch": 3, "batch": 7})
    state = ObjectState(bcast_object=bcast, get_rank=lambda: 1, epoch=5, batch=0)
    assert (state.epoch, state.batch) == (5, 0)
    state.sync()
    assert (state.epoch, state.batch, bcast.calls) == (3, 7, 1)
    state.epoch, state.batch = 4, 1
    state.restore()  # back to the last synchronised (or committed) values
    assert (state.epoch, state.batch) == (3, 7)
    state.epoch = 9
    state.commit()
    state.epoch = 10
    state.restore()
    assert state.epoch == 9


def test_run_syncs_first_and_calls_once():
    bcast = RankZeroSends({"epoch": 2})
    state = ObjectState(bcast_object=bcast, get_rank=lambda: 1, epoch=0)
    seen = []

    @run
    def train(s, extra):
        seen.append((s.epoch, extra))
        return "done"

    assert train(state, extra=1) == "done"
    assert seen == [(2, 1)] and bcast.calls == 1


def test_reset_callbacks_are_kept_and_called_on_reset():
    state = ObjectState(bcast_object=dict, get_rank=lambda: 0, epoch=0)
    called = []
    state.register_reset_callbacks([lambda: called.append(1)])
    state.on_reset()
    state.check_host_updates()  # a job that keeps its ranks: nothing to report, nothing raised
    assert called == [1]
