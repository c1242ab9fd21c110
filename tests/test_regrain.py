"""A grain DataLoader's saved position carried to another process count
(`jaxlightning.data.regrain`), checked against grain itself: grain's shard
options are plain numbers, so each "process" here is a DataLoader built with
``ShardOptions(p, P)``, and the reference is grain's own uninterrupted pass."""

import json

import grain
import numpy as np
import pytest
from absl import flags

from jaxlightning.data import regrain

N = 96
flags.FLAGS.mark_as_parsed()  # grain's data workers read absl flags (absl.app parses them)


class Numbers:
    """A grain data source whose record i is i (so batches show positions)."""

    def __len__(self):
        return N

    def __getitem__(self, i):
        return np.int64(i)

    def __repr__(self):
        return f"Numbers({N})"


def sampler(sharded_by=None):
    return grain.samplers.IndexSampler(
        num_records=N,
        shuffle=True,
        seed=3,
        num_epochs=1,
        shard_options=sharded_by or grain.sharding.NoSharding(),
    )


def make(p, shards, batch, workers=0, sampler_shards=False):
    shard = grain.sharding.ShardOptions(p, shards, drop_remainder=True)
    return grain.DataLoader(
        data_source=Numbers(),
        sampler=sampler(shard if sampler_shards else None),
        shard_options=shard,
        operations=[grain.transforms.Batch(batch_size=batch)],
        worker_count=workers,
        read_options=grain.ReadOptions(num_threads=0),
    )


ORDER = [int(sampler()[i].record_key) for i in range(N)]  # grain's global order


def run(shards, batch, steps, workers=0, **kw):
    """Each shard's first ``steps`` batches and its state after them."""
    taken, states = [], []
    for p in range(shards):
        it = iter(make(p, shards, batch, workers, **kw))
        taken.append([next(it).tolist() for _ in range(steps)])
        states.append(json.loads(it.get_state().decode()))
    return taken, states


def rest(loader, state=None, skip=0):
    """A loader's batches after ``skip`` (grain's own pass), or from ``state``."""
    it = iter(loader)
    if state is not None:
        it.set_state(json.dumps(state).encode())
    batches = [b.tolist() for b in it]
    return batches if state is not None else batches[skip:]


@pytest.mark.slow
@pytest.mark.parametrize(
    "before, steps, after",
    [((2, 8, 0), 3, (1, 16, 0)), ((1, 16, 0), 3, (2, 8, 0)), ((2, 8, 0), 3, (4, 4, 0)),
     ((4, 2, 0), 6, (3, 2, 0)), ((2, 4, 0), 4, (1, 8, 2)), ((1, 8, 2), 4, (2, 4, 0))],
    ids=["2->1", "1->2", "2->4", "4->3", "2->1 into workers", "1->2 from workers"],
)  # fmt: skip
def test_a_saved_position_continues_on_another_layout_as_an_uninterrupted_run(before, steps, after):
    (shards, batch, workers), (now, size, now_workers) = before, after
    taken, states = run(shards, batch, steps, workers)
    g = regrain.consumed(states)
    seen = sorted(x for shard in taken for b in shard for x in b)
    assert g == len(seen) and seen == sorted(ORDER[:g])  # the prefix of grain's order
    left = []
    for p in range(now):
        loader = make(p, now, size, now_workers)
        state, batches = regrain.state_at(g, regrain.layout(loader), states[0])
        assert batches * size * now == g
        resumed = rest(loader, state)
        assert resumed == rest(make(p, now, size, now_workers), skip=batches)  # grain's own
        left += [x for b in resumed for x in b]
    assert sorted(seen + left) == sorted(ORDER[: len(seen) + len(left)])
    assert len(set(seen + left)) == len(seen + left)  # nothing twice


def test_a_position_at_the_end_of_the_pass_resumes_with_nothing_left():
    _, states = run(2, 16, 3)  # 48 records a shard: 16, 16, 16
    g = regrain.consumed(states)
    assert g == N
    loader = make(0, 1, 36)  # 96 = 36 + 36 + 24: no batch boundary at 96, but the end
    state, batches = regrain.state_at(g, regrain.layout(loader), states[0])
    assert batches == 3 and rest(loader, state) == []


def test_a_sampler_sharded_by_process_has_no_position_on_another_count():
    _, states = run(2, 8, 2, sampler_shards=True)
    g = regrain.consumed(states)
    loader = make(0, 1, 16, sampler_shards=True)
    with pytest.raises(ValueError, match=r"sampler is not this run's.*give the IndexSampler no"):
        regrain.state_at(g, regrain.layout(loader), states[0])


@pytest.mark.parametrize(
    "now, size, match",
    [(3, 8, r"after 32 records .* 3 process\(es\) cannot split evenly"),
     (1, 12, r"32 for each .* 1 process\(es\), not a whole number of batches of 12")],
)  # fmt: skip
def test_positions_no_batch_of_this_run_starts_at_are_refused(now, size, match):
    _, states = run(2, 8, 2)  # 32 records in
    with pytest.raises(ValueError, match=match):
        regrain.state_at(regrain.consumed(states), regrain.layout(make(0, now, size)), states[0])


@pytest.mark.slow
def test_workers_between_turns_are_refused():
    _, states = run(1, 4, 3, workers=2)  # worker 0 made 2 batches, worker 1 one (read right)
    with pytest.raises(ValueError, match=r"workers had handed out \[8, 4\] records"):
        regrain.consumed(states)


class Odd(grain.transforms.Filter):
    def filter(self, element):
        return element % 2 == 1


def test_a_loader_whose_batches_are_not_a_fixed_number_of_records_is_refused():
    _, states = run(2, 8, 2)
    filtered = grain.DataLoader(
        data_source=Numbers(),
        sampler=sampler(),
        shard_options=grain.sharding.NoSharding(),
        operations=[Odd(), grain.transforms.Batch(batch_size=8)],
    )
    with pytest.raises(ValueError, match=r"no fixed number of records .* a Filter drops"):
        regrain.state_at(regrain.consumed(states), regrain.layout(filtered), states[0])
