"""Planner behaviour in a simulated world: dedup, replica checks, ties and empty pieces, clear errors naming the
key, caching, stock DCP compatibility. (Rank and place checks: test_planner_ranks.py; tensors and options refused
by name: test_planner_inputs.py.)"""

from __future__ import annotations

import argparse
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp
from planner_sim import FULL, TP2, load, save, tp_state
from sim import MemoryReader, MemoryStore, MemoryWriter, reset_dcp_caches, sim_load, sim_save
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner

from smpckpt import LayoutMismatch, ParallelLayout, ReplicaMismatch, ShardSpec, UnsafeCheckpoint
from smpckpt.planners import ParallelLoadPlanner, ParallelSavePlanner


def setup_function():
    reset_dcp_caches()


def test_default_planner_loses_plain_tp_shards_ours_does_not():
    store = MemoryStore()
    sim_save([tp_state(0), tp_state(1)], [DefaultSavePlanner(), DefaultSavePlanner()], [MemoryWriter(store)] * 2)
    assert store.metadata.state_dict_metadata["w"].size == torch.Size([3, 4])  # one rank's rows only
    back = [tp_state(r, blank=True) for r in range(2)]
    sim_load(back, [DefaultLoadPlanner(), DefaultLoadPlanner()], [MemoryReader(store)] * 2)
    assert torch.equal(back[0]["w"], back[1]["w"])  # both ranks got the same half: the other is lost
    assert not (torch.equal(back[0]["w"], FULL[:3]) and torch.equal(back[1]["w"], FULL[3:]))

    store, _ = save([tp_state(0), tp_state(1)], TP2, {"w": ShardSpec(0)})
    assert store.metadata.state_dict_metadata["w"].size == torch.Size([6, 4])
    full = {"w": torch.zeros(6, 4), "b": torch.zeros(4)}
    load([full], ParallelLayout(), store)
    assert torch.equal(full["w"], FULL) and torch.equal(full["b"], torch.ones(4))


def test_replicas_are_written_once_and_spread():
    layout = ParallelLayout(dp=4)
    sds = [{f"t{i}": torch.full((64 * (i % 3 + 1),), float(i)) for i in range(12)} for _ in range(4)]
    store, planners = save(sds, layout)
    assert len(store.chunks) == 12  # each replica written exactly once
    assert all(store.bytes_written.get(r, 0) > 0 for r in range(4))
    assert planners[0].report.balance < 1.3


def test_forgotten_spec_with_uneven_shards_is_caught():
    sds = [{"w": torch.ones(3, 4)}, {"w": torch.ones(2, 4)}]
    with pytest.raises(ReplicaMismatch, match=r"stage 0: ranks \[0\] hold 1 .*ranks \[1\] hold 1"):
        save(sds, TP2)


def test_uneven_zero_pieces_without_sizes_are_refused_by_key_and_shapes():
    """ZeRO pieces of 4 and 3 rows saved without ``sizes=``: each rank takes its piece's extent times the
    degree as the global one (8 vs 6); the refusal names the key, both global shapes and their ranks."""
    full = torch.arange(7.0)
    sds = [{"optim.state.w.exp_avg": full[:4].clone()}, {"optim.state.w.exp_avg": full[4:].clone()}]
    with pytest.raises(ReplicaMismatch) as err:
        save(sds, ParallelLayout(dp=2), {"optim.state.w.exp_avg": ShardSpec(0, axis="dp")})
    assert "'optim.state.w.exp_avg': global shape (8,) on ranks [0], (6,) on ranks [1]" in str(err.value)
    assert "sizes=" in str(err.value) and "empty piece" in str(err.value)
    store, _ = save(sds, ParallelLayout(dp=2), {"optim.state.w.exp_avg": ShardSpec(0, axis="dp", sizes=(4, 3))})
    back = {"optim.state.w.exp_avg": torch.zeros(7)}
    load([back], ParallelLayout(), store)
    assert torch.equal(back["optim.state.w.exp_avg"], full)


def test_a_zero_rank_holding_no_piece_must_hold_an_empty_one_and_the_step():
    """A DP rank owning none of a parameter still holds its state keys: an empty piece and the 0-d step
    (without them the ranks disagree on the keys; with them the state saves and loads bit-exactly)."""
    spec = {"s.a.exp_avg": ShardSpec(0, axis="dp", sizes=(7, 0))}
    a = torch.arange(7.0)
    sds = [{"s.a.exp_avg": a.clone(), "s.a.step": torch.tensor(2.0)}, {}]
    with pytest.raises(ReplicaMismatch, match=r"ranks \[0\] hold 2 .*ranks \[1\] hold 0.*empty piece.*0-d step"):
        save(sds, ParallelLayout(dp=2), spec)
    sds[1] = {"s.a.exp_avg": torch.zeros(0), "s.a.step": torch.tensor(2.0)}
    store, _ = save(sds, ParallelLayout(dp=2), spec)
    back = {"s.a.exp_avg": torch.zeros(7), "s.a.step": torch.tensor(0.0)}
    load([back], ParallelLayout(), store)
    assert torch.equal(back["s.a.exp_avg"], a) and torch.equal(back["s.a.step"], torch.tensor(2.0))


def test_an_empty_tensor_split_unevenly_saves_and_loads():
    """A tensor without elements (``[2, 0]``: a rank-0 adapter) split over TP with ``sizes=(0, 2)``: rank 0's
    piece is empty along the split dim, at the offset of rank 1's; only rank 1's is written (as for a
    non-empty tensor), where both were, and refused as two chunks at one offset (hunt70e)."""
    spec = {"w": ShardSpec(0, sizes=(0, 2))}
    sds = [{"w": torch.zeros(0, 0), "b": torch.ones(3)}, {"w": torch.zeros(2, 0), "b": torch.ones(3)}]
    store, _ = save(sds, TP2, spec)
    md = store.metadata.state_dict_metadata["w"]
    assert tuple(md.size) == (2, 0) and [tuple(c.sizes) for c in md.chunks] == [(2, 0)]
    back = {"w": torch.zeros(2, 0), "b": torch.zeros(3)}
    load([back], ParallelLayout(), store)
    assert back["w"].shape == (2, 0) and torch.equal(back["b"], torch.ones(3))


def _tied_pairs(sizes, apart_on=()):
    """Each TP rank's piece of one tensor split by ``sizes`` rows, held under ``emb`` and ``head``: one tensor
    under both keys, or (ranks in ``apart_on``) two tensors holding the same values."""
    sds, at = [], 0
    for r, n in enumerate(sizes):
        piece = torch.arange(6.0).reshape(3, 2)[at : at + n].clone()
        sds.append({"emb": piece, "head": piece.clone() if r in apart_on else piece})
        at += n
    return sds


def test_a_tied_pair_split_with_an_empty_piece_saves_and_loads():
    """An embedding tied to its head, split over TP with ``sizes=(0, 3)`` (a rank holding no row of it). Ties
    are told by memory, and an empty piece shows none: the rank holding nothing reported no tie, the others
    did, and the save was refused (hunt70e). The tie is the ranks' holding values of the pair (an empty piece
    neither makes nor denies one; fix71a): written once, and loaded bit-exact, the head through the embedding,
    into the same split, the whole tensor (tied, or held apart), and a split where that rank holds rows."""
    e = torch.arange(6.0).reshape(3, 2)
    spec = ShardSpec(0, sizes=(0, 3))
    store, planners = save(_tied_pairs((0, 3)), TP2, {"emb": spec, "head": spec})
    assert [p.tied for p in planners] == [{}, {"head": "emb"}]
    assert {i.fqn for i in store.chunks} == {"emb"}  # written once, under its first key
    back = {"emb": torch.zeros(3, 2)}
    back["head"] = back["emb"]
    (planner,) = load([back], ParallelLayout(), store)
    assert planner.saved_tied == {"head": "emb"} and planner.dest_tied == {"head": "emb"}
    assert torch.equal(back["emb"], e) and back["head"] is back["emb"]
    apart = {"emb": torch.zeros(3, 2), "head": torch.full((3, 2), -1.0)}  # the head read from the embedding's bytes
    load([apart], ParallelLayout(), store)
    assert torch.equal(apart["emb"], e) and torch.equal(apart["head"], e)
    for sizes in ((0, 3), (2, 1), (1, 2)):
        resplit = ShardSpec(0, sizes=sizes)
        backs = _tied_pairs(sizes)
        for b in backs:
            b["emb"].fill_(-1.0)
        planners = load(backs, TP2, store, {"emb": resplit, "head": resplit})
        assert [p.dest_tied for p in planners] == [{"head": "emb"} if n else {} for n in sizes]
        assert torch.equal(torch.cat([b["emb"] for b in backs]), e) and all(b["head"] is b["emb"] for b in backs)


def test_empty_pieces_held_apart_neither_make_nor_deny_a_tie():
    """The rank holding none of a tied pair holds its empty pieces as two tensors: no evidence either way, so
    the ranks holding values decide (this save was refused as a tie some ranks hold and others not, naming the
    key, before fix71a). A pair tied only where it is not split still disagrees among ranks holding its values:
    refused, naming the key and each rank's view."""
    e = torch.arange(6.0).reshape(3, 2)
    spec = ShardSpec(0, sizes=(0, 3))
    store, planners = save(_tied_pairs((0, 3), apart_on=(0,)), TP2, {"emb": spec, "head": spec})
    assert [p.tied for p in planners] == [{}, {"head": "emb"}]
    assert {i.fqn for i in store.chunks} == {"emb"}
    back = {"emb": torch.zeros(3, 2), "head": torch.zeros(3, 2)}
    load([back], ParallelLayout(), store)
    assert torch.equal(back["emb"], e) and torch.equal(back["head"], e)
    w = e.clone()
    with pytest.raises(
        ReplicaMismatch, match=r"'head': tied to 'emb' on ranks \[0\], a tensor of its own on ranks \[1\]"
    ):
        save([{"emb": w, "head": w}, {"emb": e.clone(), "head": e.clone()}], ParallelLayout(dp=2))


def test_zero_flat_partitions_holding_two_keys_as_empty_views_at_one_offset_are_not_tied():
    """ZeRO-style flat partitions: a rank owning none of two same-shaped parameters holds each as an empty
    view of its flat buffer at one offset with one shape (one storage, one address), while the rank holding
    their values holds them apart. Not a tie (fix70h's tie of empty pieces by their storage refused this healthy
    layout, ReplicaMismatch): saved and loaded bit-exact, every key written."""
    a, b, c = torch.arange(6.0).reshape(3, 2), -torch.arange(6.0).reshape(3, 2) - 1, torch.arange(4.0) + 100
    layout = ParallelLayout(dp=2)
    specs = {"a": ShardSpec(0, "dp", sizes=(0, 3)), "b": ShardSpec(0, "dp", sizes=(0, 3))}
    specs["c"] = ShardSpec(0, "dp", sizes=(4, 0))
    flats = [c.clone(), torch.cat([a.flatten(), b.flatten()])]  # each rank's flat partition
    sds = [
        {"a": flats[0][4:].view(0, 2), "b": flats[0][4:].view(0, 2), "c": flats[0][:4]},
        {"a": flats[1][:6].view(3, 2), "b": flats[1][6:].view(3, 2), "c": flats[1][12:]},
    ]
    one, two = sds[0]["a"], sds[0]["b"]  # one storage, one offset, one shape
    assert one.untyped_storage().data_ptr() == two.untyped_storage().data_ptr() and one.storage_offset() == 4
    store, planners = save(sds, layout, specs)
    assert [p.tied for p in planners] == [{}, {}]
    assert {i.fqn for i in store.chunks} == {"a", "b", "c"}
    back = {"a": torch.zeros(3, 2), "b": torch.zeros(3, 2), "c": torch.zeros(4)}
    (planner,) = load([back], ParallelLayout(), store)
    assert planner.saved_tied == {}
    assert torch.equal(back["a"], a) and torch.equal(back["b"], b) and torch.equal(back["c"], c)
    backs = [{k: torch.zeros_like(v) for k, v in sd.items()} for sd in sds]
    load(backs, layout, store, specs)
    assert torch.equal(backs[1]["a"], a) and torch.equal(backs[1]["b"], b) and torch.equal(backs[0]["c"], c)


def test_a_tie_ranks_holding_values_disagree_on_is_refused_naming_the_key():
    """Ranks that hold values of a tied pair must tie it alike. Across TP pieces (rank 0 ties its row, rank 1
    holds its two apart): refused by the writes. Within one piece's replicas (tp=2, dp=2: ranks 1 and 3 hold
    TP piece 1, rank 1 apart with other values, rank 3 tied): rank 3 wrote the piece as the tie's, and rank 1's
    head was dropped in silence with the value check off (the ties of split keys are left out of the stage's
    digest, as an empty piece shows none): refused naming the key and both ranks."""
    spec = ShardSpec(0, sizes=(1, 2))
    with pytest.raises(
        ReplicaMismatch,
        match=r"'head' is tied to 'emb' \(the same tensor\) on rank 0 but is a tensor of its own on rank 1",
    ):
        save(_tied_pairs((1, 2), apart_on=(1,)), TP2, {"emb": spec, "head": spec})
    layout, spec = ParallelLayout(tp=2, dp=2), ShardSpec(0, sizes=(0, 3))
    sds = _tied_pairs((0, 3)) * 2  # ranks 0, 1 then 2, 3 (TP fastest)
    sds[1] = {"emb": sds[1]["emb"].clone(), "head": -sds[1]["emb"]}
    with pytest.raises(
        ReplicaMismatch,
        match=r"'head' is tied to 'emb' \(the same tensor\) on ranks \[3\] but is a tensor of its own on ranks \[1\], "
        "which hold the same piece of it",
    ):
        save(sds, layout, {"emb": spec, "head": spec}, verify_replicas=False)


def test_a_split_tied_pair_keeps_the_replica_value_checks_aligned():
    """tp=2, dp=2, a tied pair split over TP with TP rank 0 empty (tied on ranks 1 and 3 only), a replicated
    ``w`` and a TP-split ``z``. The split tied key stays on every rank's value-check lists (fix71a): dropped
    from them on the ranks tying it only, the lists of the ranks differed and a DP replica (rank 3) drifted
    on ``w`` or ``z`` saved in silence (rev71a M1). Each drift is refused, naming the ranks."""
    layout, spec = ParallelLayout(tp=2, dp=2), ShardSpec(0, "tp", sizes=(0, 3))
    specs = {"emb": spec, "head": spec, "z": ShardSpec(0, "tp")}

    def world(drift=None):
        sds = [
            _tied_pairs((0, 3))[r % 2] | {"w": torch.arange(8.0), "z": torch.arange(2.0) + 10 * (r % 2)}
            for r in range(4)
        ]
        if drift:
            sds[3][drift] = sds[3][drift] + 1
        return sds

    store, _ = save(world(), layout, specs)
    assert {i.fqn for i in store.chunks} == {"emb", "w", "z"}
    for drift, where in (
        ("w", r"ranks 0 and 3 hold different values"),
        ("z", r"ranks 1 and 3 hold different values of 'z'"),
    ):
        reset_dcp_caches()
        with pytest.raises(ReplicaMismatch, match=where):
            save(world(drift), layout, specs)


def test_a_split_tied_key_weighs_nothing_in_its_replica_groups_owner_choice():
    """tp=2, dp=2, a pair tied on every rank and split over TP (rows 1 and 2), and a TP-split ``z``: the tied
    key writes nothing (its bytes are its first key's), so it weighs nothing when each piece's DP replicas
    share the writes (fix71a): ``emb`` on DP rank 0 of each piece, ``z`` on DP rank 1 (weighed at its bytes,
    ``head`` took DP rank 1's turn and ``z`` went to DP rank 0 too). Plans list only split ties' axes."""
    layout, spec = ParallelLayout(tp=2, dp=2), ShardSpec(0, "tp", sizes=(1, 2))
    specs = {"emb": spec, "head": spec, "z": ShardSpec(0, "tp")}
    sds = [_tied_pairs((1, 2))[r % 2] | {"z": torch.arange(4.0)[2 * (r % 2) :][:2].clone()} for r in range(4)]
    writes = []
    for rank, sd in enumerate(sds):
        planner = ParallelSavePlanner(layout, specs, rank=rank)
        planner.set_up_planner(sd, is_coordinator=rank == 0)
        plan = planner.create_local_plan()
        writes.append(sorted(i.index.fqn for i in plan.items))
        assert plan.planner_data["tied"] == {"head": "emb"} and plan.planner_data["tie_axes"] == {"head": ["tp"]}
    assert writes == [["emb"], ["emb"], ["z"], ["z"]]
    untied = ParallelSavePlanner(TP2, rank=0)
    untied.set_up_planner(tp_state(0), is_coordinator=True)
    assert "tie_axes" not in untied.create_local_plan().planner_data  # sent only when a split key is tied


@pytest.mark.parametrize("order", [("emb", "head"), ("head", "emb")])
def test_a_pair_tied_where_only_one_key_is_split_saves_alike_in_either_key_order(order):
    """TP=2: ``emb`` split with every row on TP rank 1 (``sizes=(0, 3)``), ``head`` held whole on both ranks,
    and on rank 1 the same tensor as ``emb`` (its piece is the whole). Rank 0 holds the head as a tensor of its
    own and an empty ``emb``: it cannot tell the tie. Tied to the split ``emb`` (order emb, head) the head's tie
    entered the stage's digest and the save was refused; tied the other way it saved (rev71a L1). A tie is
    split when either key is: both orders save, and load bit-exact into the same layout and whole (tied, or
    held apart). Rank 0's head must still equal rank 1's: one with other values is refused."""
    e = torch.arange(6.0).reshape(3, 2)
    specs = {"emb": ShardSpec(0, sizes=(0, 3))}

    def world(head0):
        sds = []
        for rows in (0, 3):
            emb = e[:rows].clone()
            held = {"emb": emb, "head": emb if rows else head0}
            sds.append({k: held[k] for k in order})
        return sds

    store, planners = save(world(e.clone()), TP2, specs)
    assert [p.tied for p in planners] == [{}, {"emb": "head"} if order[0] == "head" else {}]
    backs = world(torch.full((3, 2), -1.0))  # rank 1 tied again
    backs[1]["emb"].fill_(-1.0)
    load(backs, TP2, store, specs)
    assert torch.equal(backs[1]["emb"], e) and all(torch.equal(b["head"], e) for b in backs)
    assert backs[1]["head"] is backs[1]["emb"]
    for tied in (True, False):
        back = {"emb": torch.zeros(3, 2)}
        back["head"] = back["emb"] if tied else torch.zeros(3, 2)
        load([back], ParallelLayout(), store)
        assert torch.equal(back["emb"], e) and torch.equal(back["head"], e)
    reset_dcp_caches()
    with pytest.raises(ReplicaMismatch, match=r"ranks 0 and 1 hold different values"):
        save(world(-e), TP2, specs)


@pytest.mark.parametrize("order", [("emb", "head", "out"), ("head", "emb", "out"), ("head", "out", "emb")])
def test_three_keys_tied_where_only_the_first_is_split_save_in_every_key_order(order):
    """The pair's rule for a group of three: ``emb`` split with every row on TP rank 1, ``head`` and ``out``
    whole and one tensor on every rank (on rank 1 also ``emb``'s). In order emb, head, out rank 1 dropped both
    ties to the split ``emb`` while rank 0 kept ``out`` tied to ``head``: refused (rev71g M1). The unsplit keys
    now tie to the group's first unsplit key: every order saves and loads bit-exact, same layout and whole."""
    e = torch.arange(6.0).reshape(3, 2)
    specs = {"emb": ShardSpec(0, sizes=(0, 3))}

    def world(fill):
        sds = []
        for rows in (0, 3):
            emb = e[:rows].clone() if fill is None else torch.full((rows, 2), fill)
            head = emb if rows else (e.clone() if fill is None else torch.full((3, 2), fill))
            held = {"emb": emb, "head": head, "out": head}
            sds.append({k: held[k] for k in order})
        return sds

    store, _ = save(world(None), TP2, specs)
    backs = world(-1.0)
    load(backs, TP2, store, specs)
    assert torch.equal(backs[1]["emb"], e) and all(torch.equal(b[k], e) for b in backs for k in ("head", "out"))
    back = {k: torch.zeros(3, 2) for k in order}
    load([back], ParallelLayout(), store)
    assert all(torch.equal(back[k], e) for k in order)


def test_async_staging_leaves_empty_pieces_untied_and_saves_as_a_synchronous_save():
    """Staging copies an empty tensor into a buffer of its own (no address to share), as the planners tie no
    empty piece: a tied pair's empty piece and a flat partition's empty views stage apart; staged, the pair
    saves tied (from the rank holding its values) and the views untied, and both load bit-exact."""
    from smpckpt.api._staging import Stager

    e, f = torch.arange(6.0).reshape(3, 2), -torch.arange(6.0).reshape(3, 2) - 1
    spec = ShardSpec(0, sizes=(0, 3))
    flat = torch.zeros(4)
    staged = []
    for rows in (0, 3):
        tied = e[:rows].clone()
        views = (flat[4:].view(0, 2), flat[4:].view(0, 2)) if not rows else (f.clone(), -f)
        state, _ = Stager().stage("t", {"emb": tied, "head": tied, "a": views[0], "b": views[1]}, set())
        staged.append(state)
    assert staged[1]["emb"] is staged[1]["head"] and staged[0]["emb"] is not staged[0]["head"]
    specs = dict.fromkeys(("emb", "head", "a", "b"), spec)
    store, planners = save(staged, TP2, specs)
    assert [p.tied for p in planners] == [{}, {"head": "emb"}]
    full = {k: torch.zeros(3, 2) for k in specs}
    load([full], ParallelLayout(), store)
    assert torch.equal(full["head"], e) and torch.equal(full["a"], f) and torch.equal(full["b"], -f)


def test_per_rank_tensors_need_rank_local():
    sds = [{"w": torch.ones(2), f"rng.rank{r}": torch.tensor([r])} for r in range(2)]
    with pytest.raises(ReplicaMismatch, match="rank_local"):
        save(sds, TP2)
    store, _ = save(sds, TP2, rank_local=["rng.*"])
    assert torch.equal(store.chunks[next(i for i in store.chunks if i.fqn == "rng.rank1")], torch.tensor([1]))


def test_objects_that_differ_between_ranks_are_refused():
    sds = [{"w": torch.ones(2), "step": r} for r in range(2)]
    with pytest.raises(ReplicaMismatch, match="'step' differs between ranks"):
        save(sds, TP2)


def test_missing_unexpected_shape_dtype_errors_name_the_key():
    store, _ = save([tp_state(0), tp_state(1)], TP2, {"w": ShardSpec(0)})
    with pytest.raises(LayoutMismatch, match=r"1 keys are not in the checkpoint: extra"):
        load([{"w": torch.zeros(6, 4), "b": torch.zeros(4), "extra": torch.zeros(1)}], ParallelLayout(), store)
    with pytest.raises(LayoutMismatch, match=r"checkpoint keys are loaded by no rank: b"):
        load([{"w": torch.zeros(6, 4)}], ParallelLayout(), store)
    with pytest.raises(LayoutMismatch, match=r"w: the checkpoint holds global shape \(6, 4\) but .* implies \(5, 4\)"):
        load([{"w": torch.zeros(5, 4), "b": torch.zeros(4)}], ParallelLayout(), store)
    with pytest.raises(LayoutMismatch, match=r"w: saved as torch.float32 but the destination is torch.float16"):
        load([{"w": torch.zeros(6, 4, dtype=torch.float16), "b": torch.zeros(4)}], ParallelLayout(), store)

    sd = {"w": torch.zeros(6, 4, dtype=torch.float64), "extra": torch.zeros(1)}
    planners = load([sd], ParallelLayout(), store, allow_partial_load=True, allow_dtype_cast=True)
    assert torch.equal(sd["w"], FULL.double()) and torch.equal(sd["extra"], torch.zeros(1))
    report = planners[0].report
    assert report.missing_keys == ("extra",) and report.unexpected_keys == ("b",) and report.cast_keys == ("w",)


def test_a_key_saved_nested_the_other_way_is_named_as_such_not_as_absent():
    """A dict saved under ``x`` is stored as ``x.a`` (DCP flattens it): a tensor asked for as ``x`` was
    refused as "not in the checkpoint", as was ``x.a`` asked of a checkpoint holding ``x`` whole."""
    one = ParallelLayout()
    store, _ = save([{"x": {"a": torch.ones(2)}, "y": torch.ones(3)}], one)
    with pytest.raises(LayoutMismatch, match=r"x: the checkpoint holds a container there \(keys x\.a\), not one value"):
        load([{"x": torch.zeros(2), "y": torch.zeros(3)}], one, store)
    with pytest.raises(LayoutMismatch, match=r"y\.b: the checkpoint holds 'y' whole \(a tensor\)"):
        load([{"x": {"a": torch.zeros(2)}, "y": {"b": torch.zeros(3)}}], one, store)


def test_reshard_reports_fast_path_vs_overlap():
    store, _ = save([tp_state(0), tp_state(1)], TP2, {"w": ShardSpec(0)})
    same = [tp_state(r, blank=True) for r in range(2)]
    planners = load(same, TP2, store, {"w": ShardSpec(0)})
    assert planners[0].report.resharded == () and planners[0].report.saved_layout == TP2
    assert torch.equal(same[1]["w"], FULL[3:])
    three = ParallelLayout(tp=3)
    sds = [{"w": torch.zeros(2, 4), "b": torch.zeros(4)} for _ in range(3)]
    planners = load(sds, three, store, {"w": ShardSpec(0)})
    assert planners[1].report.resharded == ("w",)
    assert torch.equal(torch.cat([sd["w"] for sd in sds]), FULL)


def test_objects_load_weights_only_unless_allowed():
    sds = [{"w": torch.ones(2), "args": argparse.Namespace(lr=0.1)} for _ in range(2)]
    with pytest.warns(
        UserWarning, match=r"1 saved objects load only with allow_pickle=True .*args \(argparse\.Namespace\)"
    ):
        store, _ = save(sds, TP2)
    with pytest.raises(UnsafeCheckpoint, match="args: the stored object needs arbitrary code"):
        load([{"w": torch.zeros(2), "args": None}], ParallelLayout(), store)
    sd = {"w": torch.zeros(2), "args": None}
    load([sd], ParallelLayout(), store, allow_pickle=True)
    assert sd["args"] == argparse.Namespace(lr=0.1)


def test_objects_under_non_string_keys_load_into_those_keys():
    # DCP flattens {0: x} to the key "0" and its set_element wrote a loaded object under a new key "0",
    # leaving the caller's 0 at its old value (a param-index optimizer state dict's ints, for example)
    saved = {"optim": {"state": {0: {"step": 3, "exp_avg": torch.ones(2)}}, "flags": {True: "on", 1.5: [4, 5]}}}
    store, _ = save([saved], ParallelLayout())
    dest = {"optim": {"state": {0: {"step": 0, "exp_avg": torch.zeros(2)}}, "flags": {True: "off", 1.5: []}}}
    load([dest], ParallelLayout(), store)
    assert dest["optim"]["state"] == {0: {"step": 3, "exp_avg": dest["optim"]["state"][0]["exp_avg"]}}
    assert torch.equal(dest["optim"]["state"][0]["exp_avg"], torch.ones(2))
    assert dest["optim"]["flags"] == {True: "on", 1.5: [4, 5]}  # no "True" or "1.5" beside them
    # two keys of one mapping with one name (0 and "0") merged their subtrees in the checkpoint, and the
    # loaded x landed in the "0" dict, leaving 0's stale: refused on save and load, naming both
    both = {"d": {0: {"x": "a"}, "0": {"y": "b"}}}
    with pytest.raises(ValueError, match=r"d: the keys \[0, '0'\] have one name in a checkpoint"):
        save([both], ParallelLayout())
    with pytest.raises(ValueError, match=r"the state dict: the keys \[1\.5, '1\.5'\]"):
        load([{1.5: {"a": 1}, "1.5": {"b": 2}, **saved}], ParallelLayout(), store)


def test_plan_cache_reuses_plans_per_instance_and_invalidates_on_change():
    layout = ParallelLayout(tp=2, dp=2)
    specs = {"w": ShardSpec(0)}
    planners = [ParallelSavePlanner(layout, specs, rank=r) for r in range(4)]

    def state(scale, rows=3):
        return [
            {"w": torch.full((rows, 2), scale * (r % 2 + 1)), "b": torch.full((2,), scale), "lr": 0.1} for r in range(4)
        ]

    for scale, expect_cached in ((1.0, False), (2.0, True), (3.0, True)):
        store = MemoryStore()
        sim_save(state(scale), planners, [MemoryWriter(store) for _ in range(4)])
        assert planners[0].report.cached is expect_cached
        full = {"w": torch.zeros(6, 2), "b": torch.zeros(2), "lr": 0.0}
        load([full], ParallelLayout(), store)
        assert torch.equal(full["w"], torch.cat([torch.full((3, 2), scale), torch.full((3, 2), 2 * scale)]))
        assert torch.equal(full["b"], torch.full((2,), scale))
    store = MemoryStore()
    sim_save(state(4.0, rows=4), planners, [MemoryWriter(store) for _ in range(4)])  # shape changed
    assert planners[0].report.cached is False
    assert store.metadata.state_dict_metadata["w"].size == torch.Size([8, 2])


def test_two_worlds_in_one_process_do_not_share_plans():
    a, _ = save([tp_state(0), tp_state(1)], TP2, {"w": ShardSpec(0)})
    b, _ = save([{"x": torch.ones(3)}, {"x": torch.ones(3)}], TP2)
    assert set(a.metadata.state_dict_metadata) == {"w", "b"}
    assert set(b.metadata.state_dict_metadata) == {"x"}


def test_partial_checkpoint_into_another_view_says_how_to_load_it(tmp_path):
    """Saved as a plain fused [3h, d]; loaded into a TP=2 layout viewing it as [3, h, d]: refused with
    the way out, and the way out (consolidate, then load the full artifact) is bit-exact."""
    from smpckpt import consolidate_checkpoint
    from smpckpt.storage import FsspecStorageReader, FsspecStorageWriter

    qkv = torch.arange(24, dtype=torch.float32).reshape(6, 4)
    dcp.save(
        {"qkv": qkv.clone()},
        storage_writer=FsspecStorageWriter(tmp_path / "p"),
        no_dist=True,
        planner=ParallelSavePlanner(ParallelLayout()),
    )
    tp2, spec = ParallelLayout(tp=2), {"qkv": ShardSpec(1, view=(3, -1, 4))}

    def load_from(path):
        out = [{"qkv": torch.zeros(3, 4)} for _ in range(2)]
        readers = [FsspecStorageReader(path) for _ in range(2)]
        sim_load(out, [ParallelLoadPlanner(tp2, spec, rank=r) for r in range(2)], readers)
        return out

    with pytest.raises(LayoutMismatch, match=r"qkv: the checkpoint holds global shape \(6, 4\) .*consolidate it first"):
        load_from(tmp_path / "p")
    consolidate_checkpoint(tmp_path / "p", tmp_path / "full", progress=False)
    out = load_from(tmp_path / "full")
    for r in range(2):
        assert torch.equal(out[r]["qkv"], qkv.view(3, 2, 4)[:, r, :])
    # a shape that is not another view of the same elements gets no such hint
    with pytest.raises(LayoutMismatch) as info:
        sim_load(
            [{"qkv": torch.zeros(5, 4)}], [ParallelLoadPlanner(ParallelLayout())], [FsspecStorageReader(tmp_path / "p")]
        )
    assert "consolidate" not in str(info.value)


def test_stock_dcp_load_reads_our_checkpoint(tmp_path):
    """Saved by our planner through DCP's own FileSystemWriter: stock dcp.load needs nothing of ours."""
    layout = ParallelLayout(tp=2, pp=2, pp_layers=(1, 1))
    sds = []
    for r in range(4):
        c = layout.coords(r)
        rows = FULL.chunk(2, dim=0)[c.tp].clone() + 100 * c.pp
        sds.append({"model": {"layers": {"0": {"w": rows}}}, "extra": {"step": 7}})
    planners = [ParallelSavePlanner(layout, {"model.layers.*.w": ShardSpec(0)}, rank=r) for r in range(4)]
    sim_save(sds, planners, [FileSystemWriter(tmp_path) for _ in range(4)])
    full = {"model": {"layers": {"0": {"w": torch.zeros(6, 4)}, "1": {"w": torch.zeros(6, 4)}}}, "extra": {"step": 0}}
    dcp.load(full, storage_reader=FileSystemReader(tmp_path), planner=DefaultLoadPlanner())
    assert torch.equal(full["model"]["layers"]["0"]["w"], FULL)
    assert torch.equal(full["model"]["layers"]["1"]["w"], FULL + 100)
    assert full["extra"]["step"] == 7
    md = FileSystemReader(tmp_path).read_metadata()
    assert md.planner_data["__smpckpt__"]["layout"]["pp_layers"] == [1, 1]
    assert pickle.loads(pickle.dumps(md)).planner_data["model.layers.1.w"] == ("model", "layers", "1.w")

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(tmp_path, tmp_path / "full.pt")
    flat = torch.load(tmp_path / "full.pt", weights_only=True)
    assert torch.equal(flat["model"]["layers"]["1.w"], FULL + 100)


def test_rank_local_keys_of_other_ranks_are_not_unexpected():
    sds = [{"w": torch.ones(2), f"rng.rank{r}": torch.tensor([r])} for r in range(2)]
    store, _ = save(sds, TP2, rank_local=["rng.*"])
    one = {"w": torch.zeros(2), "rng.rank0": torch.tensor([9])}
    load([one], ParallelLayout(), store, rank_local=["rng.*"])
    assert torch.equal(one["rng.rank0"], torch.tensor([0])) and torch.equal(one["w"], torch.ones(2))
    with pytest.raises(LayoutMismatch, match="rng.rank1"):
        load([{"w": torch.zeros(2), "rng.rank0": torch.tensor([9])}], ParallelLayout(), store)


def test_likely_causes_fire_only_on_their_own_patterns() -> None:
    """rev61g F5: a model buffer named ``initial_lr`` got the scheduler hint, and smpckpt's own flattened keys
    of a top-level ParameterList (``optim.param_groups.0.lr``) the "unflattened" one."""
    from smpckpt.planners._key_notes import likely_causes

    assert likely_causes(["model.initial_lr"], []) == ""
    assert "LR scheduler" in likely_causes(["optim.param_groups.weight.initial_lr"], [])
    assert likely_causes(["optim.param_groups.0.lr"], ["optim.param_groups.0.lr"]) == ""
    assert "unflattened" in likely_causes([], ["optim.param_groups.0.params", "optim.param_groups.0.lr"])
