"""recipe="auto": the cost model keeps compression off a fast link and turns it on over a slow
one (measured numbers injected), prices every option through its plan's own wire bytes, and
returns a typed decision that is printed, run, and kept in the checkpoint; the measurement is
the same on every rank."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

import qsdp
from qsdp import comm as qc
from qsdp.policy import AutoDecision
from qsdp.policy.auto import (
    WIRE_EXPOSED,
    Measured,
    check_state_entry,
    choose,
    choose_fsdp,
    measure,
    predict_ddp,
    predict_fsdp,
    saved_decision,
    state_entry,
    wire_bytes_ddp,
    wire_bytes_fsdp,
)
from qsdp.testing import run_distributed

CODEC = {8: 2e-11, 4: 2.5e-11}  # ~50 G elements/s: a GPU's encode + decode
GPT_1_4B = [1416302592 // 25 // 4] * 25  # per-rank shards of 25 groups on 4 ranks
NVLINK = Measured(latency_s=20e-6, bytes_per_s=300e9, codec_s_per_element=CODEC, world=4)
SOCKET = Measured(latency_s=200e-6, bytes_per_s=3e9, codec_s_per_element=CODEC, world=4)


def test_fast_link_stays_uncompressed_slow_link_compresses():
    fast, slow = predict_fsdp(GPT_1_4B, NVLINK), predict_fsdp(GPT_1_4B, SOCKET)
    assert choose_fsdp(fast) == ("none", "none")
    assert choose_fsdp(slow) == ("wd4", "g4")  # sdp4bit's two halves
    # the bytes' ratio shows on the slow link: ~4x fewer gathered, ~7x fewer reduced bytes
    assert slow["weights"]["none"] / slow["weights"]["wd4"] > 4
    assert slow["grads"]["none"] / slow["grads"]["g4"] > 4
    assert slow["grads"]["g4"] < slow["grads"]["g8"] < slow["grads"]["none"]


def test_each_collective_is_chosen_apart():
    # a link fast enough that 8-bit weights pay but 4-bit codecs do not
    codec = {8: 1e-12, 4: 4e-10}
    mid = Measured(latency_s=0.0, bytes_per_s=30e9, codec_s_per_element=codec, world=4)
    assert choose_fsdp(predict_fsdp(GPT_1_4B, mid)) == ("w8", "g8")


def test_ddp_picks_cgx_over_sockets_and_nothing_over_nvlink():
    assert choose(predict_ddp(124_000_000, NVLINK, buckets=20)) == "bf16"
    slow = predict_ddp(124_000_000, SOCKET, buckets=20)
    assert choose(slow) == "cgx" and slow["cgx"] < slow["global-qsgd"] < slow["bf16"]


def test_the_margin_keeps_a_marginal_gain_off():
    assert choose({"bf16": 1.0, "cgx": 0.85}) == "bf16"
    assert choose({"bf16": 1.0, "cgx": 0.75}) == "cgx"
    assert choose({"bf16": 1.0, "cgx": 0.85}, margin=0.9) == "cgx"


def test_a_timing_is_the_fastest_repeat(monkeypatch):
    # noise only adds time: a median of three let one slow repeat set a link's bandwidth
    import qsdp.policy._measure as probe

    clock = iter([0.0, 9.0, 10.0, 10.001, 20.0, 23.0, 30.0, 30.5, 40.0, 47.0])
    monkeypatch.setattr(probe.time, "perf_counter", lambda: next(clock))
    calls = []
    assert probe._timed(lambda: calls.append(1), torch.device("cpu")) == pytest.approx(0.001)
    assert len(calls) == 6  # one warm-up, five timed


def _measure(rank: int, world: int) -> tuple:
    m = measure(None, torch.device("cpu"), sizes=(1 << 10, 1 << 16), codec_sizes=(1 << 10, 1 << 14))
    per_call = tuple(sorted(m.codec_s_per_call.items()))
    return (
        m.latency_s,
        m.bytes_per_s,
        tuple(sorted(m.codec_s_per_element.items())),
        m.world,
        per_call,
    )


def test_measure_gives_every_rank_the_same_numbers():
    results = run_distributed(_measure, 3)
    assert len(set(results)) == 1
    latency, bandwidth, codec, world, per_call = results[0]
    assert world == 3 and latency >= 0 and bandwidth > 0 and all(t > 0 for _, t in codec)
    assert [b for b, _ in per_call] == [4, 8] and all(t >= 0 for _, t in per_call)


@pytest.mark.parametrize("world", [2, 8])
def test_predictions_grow_with_the_world_on_a_ring(world):
    m = Measured(latency_s=0.0, bytes_per_s=1e9, codec_s_per_element=CODEC, world=world)
    p = predict_fsdp([1 << 20], m, wire_exposed=1.0)
    # uncompressed: 2 bf16 gathers + 1 fp32 reduce-scatter of n * m elements, on a ring
    ring = (world - 1) / world * world * (1 << 20) / 1e9
    assert p["weights"]["none"] == pytest.approx(ring * 2 * 2)
    assert p["grads"]["none"] == pytest.approx(ring * 4)
    half = predict_fsdp([1 << 20], m)  # by default half of each wire time is counted
    assert half["weights"]["none"] == pytest.approx(ring * 2 * 2 * WIRE_EXPOSED)
    with pytest.raises(ValueError, match=r"wire_exposed=0: the share of a wire time"):
        predict_fsdp([1 << 20], m, wire_exposed=0)


def test_nvlink_as_measured_keeps_weights_uncompressed():
    # 4x H200 NVLink, 1.42 B GPT (benchmarks/results/auto_2026-11-27): the fastest-of-five probe
    # read 270-316 GB/s; its report (305 GB/s, 34 us; weights none 15.6 ms, wd4 10.6 ms, w8
    # 28.9 ms) puts the 4-bit encode + decode at ~5.6 ps and the 8-bit at ~7 ps per element:
    # ~8 ms of codec per step for 4-bit weights. Counting the whole wire chose 4-bit weight
    # differences, which ran at 0.85x of plain FSDP2
    codec = {8: 7.0e-12, 4: 5.6e-12}
    m = Measured(latency_s=34e-6, bytes_per_s=305e9, codec_s_per_element=codec, world=4)
    shards = [1416302592 // 25 // 4] * 25
    assert choose_fsdp(predict_fsdp(shards, m, wire_exposed=1.0))[0] == "wd4"  # the defect
    assert choose_fsdp(predict_fsdp(shards, m)) == ("none", "none")
    slow = replace(m, bytes_per_s=25e9)  # a PCIe-class link: compression pays again
    assert choose_fsdp(predict_fsdp(shards, slow))[0] == "wd4"


# odd shard sizes (not multiples of any group size) at an odd world size
SHARDS, WORLD = [1001, 3, 77_777], 3


def test_each_option_is_priced_by_its_plans_wire_bytes():
    w8, wd4 = qsdp.recipe("qsdp-w8g8").weights, qsdp.recipe("sdp4bit").weights
    g8, g4 = (qsdp.recipe(n).grads.plan() for n in ("qsdp-w8g8", "sdp4bit"))
    two = qsdp.recipe("sdp4bit").grads
    got = wire_bytes_fsdp(SHARDS, WORLD, compute_bytes=2, reduce_bytes=4)
    assert got["weights"] == {
        "none": sum(2 * k * 2 for k in SHARDS),  # FSDP2's own gathers, forward and backward
        "w8": sum(2 * qc.all_gather_wire_bytes(k, w8.spec) for k in SHARDS),
        "wd4": sum(qc.all_gather_diff_wire_bytes(k, wd4.spec) for k in SHARDS),  # gathered once
    }
    plain = qc.PlainReduce(name="reduce_scatter")
    n = WORLD
    assert got["grads"] == {
        "none": sum(plain.reduce_scatter_wire_bytes(n * k, n, element_size=4) for k in SHARDS),
        "g8": sum(g8.reduce_scatter_wire_bytes(n * k, n) for k in SHARDS),
        "g4": sum(g4.reduce_scatter_wire_bytes(n * k, n) for k in SHARDS),
    }
    # two levels: the hierarchical reduce-scatter's bytes over a 2 x 2 mesh
    tl = wire_bytes_fsdp(SHARDS, 4, levels=(2, 2))["grads"]["tl"]
    assert tl == sum(
        qc.hierarchical_reduce_scatter_wire_bytes(4 * k, 2, 2, two.intra, two.inter) for k in SHARDS
    )
    # DDP: each recipe's all-reduce, bucket by bucket (7 buckets of an odd count)
    numel, buckets = 1_000_003, 7
    sizes = [numel // buckets + (i < numel % buckets) for i in range(buckets)]
    for name, nbytes in wire_bytes_ddp(numel, n, buckets=buckets, element_size=2).items():
        grads = qsdp.recipe(name).grads
        plan = grads.plan() if grads is not None else qc.PlainReduce()
        assert nbytes == sum(plan.all_reduce_wire_bytes(k, n, element_size=2) for k in sizes)


def _wire_only(world: int) -> Measured:
    """A link of 1 GB/s, no latency, free codecs: a prediction is its bytes' wire time."""
    free = {8: 0.0, 4: 0.0}
    return Measured(latency_s=0.0, bytes_per_s=1e9, codec_s_per_element=free, world=world)


@pytest.mark.parametrize("k", [5001, 2048 * 3 + 1])
def test_the_prediction_prices_what_the_recipes_send(k):
    # sdp4bit sends its 4-bit weight differences in groups of 2048 (one scale per 2048, not per
    # 128), qsdp-w8g8 its weights in absmax groups, cgx its gradients in min-max groups of 256:
    # the model priced quantizers of its own until 2026-11-27
    n, m = 3, _wire_only(3)
    wd4 = qsdp.recipe("sdp4bit").weights.spec
    w8 = qsdp.recipe("qsdp-w8g8").weights.spec
    assert wd4.group_size == 2048
    p = predict_fsdp([k], m, wire_exposed=1.0)
    assert p["weights"]["wd4"] == pytest.approx((n - 1) * wd4.payload_bytes(k) / 1e9, rel=1e-12)
    assert p["weights"]["w8"] == pytest.approx(2 * (n - 1) * w8.payload_bytes(k) / 1e9, rel=1e-12)
    cgx = qsdp.recipe("cgx").grads.plan()
    ddp = predict_ddp(n * k, m, wire_exposed=1.0)
    ring = 2 * (n - 1) / n * cgx.all_reduce_wire_bytes(n * k, n) / 1e9
    assert ddp["cgx"] == pytest.approx(ring, rel=1e-12)


def _integrations(rank: int, world: int) -> tuple:
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ..models import batch, classifier

    init_device_mesh("cpu", (world,))
    model = classifier()
    for i in (2, 5):
        fully_shard(model[i])
    fully_shard(model)
    qsdp.compress_fsdp(model, "auto")
    state = qsdp.fsdp.comm_state(model)
    decision = state.decision
    assert isinstance(decision, AutoDecision) and decision.all_reduce is None
    assert state.config == decision.config()  # what runs is what was chosen, per collective
    assert set(decision.predicted_s) == set(decision.wire_bytes) == {"weights", "grads"}
    if (decision.weights, decision.grads) == ("none", "none"):
        assert decision.recipe == "bf16"
    x, y = batch(rank, 0)
    nn.functional.cross_entropy(model(x), y).backward()  # it trains
    ddp = DDP(classifier())
    hook = qsdp.ddp.register(ddp, "auto")
    assert hook.config == hook.decision.config() == qsdp.recipe(hook.decision.all_reduce)
    nn.functional.cross_entropy(ddp(x), y).backward()
    return decision.recipe, hook.decision.recipe


def test_auto_in_compress_fsdp_and_ddp_agrees_on_every_rank():
    choices = run_distributed(_integrations, 2)
    assert len(set(choices)) == 1, choices


def _hsdp(rank: int, world: int) -> str:
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from ..models import batch, classifier

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = classifier()
    for i in (2, 5):
        fully_shard(model[i], mesh=mesh["shard"])
    fully_shard(model, mesh=mesh["shard"])
    qsdp.compress_fsdp(model, "auto", replicate=mesh["replicate"])
    decision = qsdp.fsdp.comm_state(model).decision
    # the all-reduce options across the nodes, measured on the replicate group (2 ranks)
    assert set(decision.predicted_s["all_reduce"]) == {"bf16", "cgx", "qsdp-g8", "global-qsgd"}
    assert decision.measured.world == 2 and decision.weights is None
    x, y = batch(rank, 0)
    nn.functional.cross_entropy(model(x), y).backward()
    return decision.recipe


def test_auto_for_compressed_hsdp_decides_the_replicate_all_reduce():
    assert len(set(run_distributed(_hsdp, 4))) == 1


CODEC_CALL = {8: 1e-5, 4: 2e-5}
INTER = Measured(latency_s=200e-6, bytes_per_s=3e9, codec_s_per_element=CODEC, world=2)
INTRA = Measured(latency_s=20e-6, bytes_per_s=300e9, codec_s_per_element=CODEC, world=2)


def _decision(weights: str, grads: str, *, levels: bool = False) -> AutoDecision:
    """An FSDP2 decision over SOCKET (and two levels), as the policy builds one."""
    m = replace(SOCKET, codec_s_per_call=CODEC_CALL)
    lv = (INTER, INTRA) if levels else None
    inputs = {"levels": lv}
    return AutoDecision(
        weights=weights,
        grads=grads,
        predicted_s=predict_fsdp(GPT_1_4B, m, **inputs),
        predicted_serial_s=predict_fsdp(GPT_1_4B, m, **inputs, wire_exposed=1.0),
        wire_bytes=wire_bytes_fsdp(GPT_1_4B, 4, levels=(2, 2) if levels else None),
        measured=m,
        levels=lv,
    )


def _all_reduce(choice: str, **kw) -> AutoDecision:
    return AutoDecision(
        all_reduce=choice,
        predicted_s={"all_reduce": predict_ddp(124_000_000, SOCKET, buckets=20)},
        predicted_serial_s={"all_reduce": predict_ddp(124_000_000, SOCKET, wire_exposed=1.0)},
        wire_bytes={"all_reduce": wire_bytes_ddp(124_000_000, 4, buckets=20)},
        **({"measured": SOCKET} | kw),
    )


def test_the_decision_builds_its_config_from_the_named_recipes():
    assert _decision("wd4", "g4").config() == qsdp.recipe("sdp4bit")
    assert _decision("w8", "g8").config() == qsdp.recipe("qsdp-w8g8")
    assert _decision("none", "none").config() == qsdp.recipe("bf16")
    assert _all_reduce("cgx").config() == qsdp.recipe("cgx")  # DDP, HSDP: a named recipe
    assert _decision("wd4", "g4").recipe == "sdp4bit" and not _decision("wd4", "g4").two_level
    tl = _decision("wd4", "tl", levels=True)
    assert tl.config() == qsdp.recipe("sdp4bit") and tl.two_level  # compress_fsdp keeps the mesh
    assert tl.recipe == "sdp4bit (two levels, 2 x 2)"
    mixed = _decision("w8", "none")  # no named recipe: its options; QSDP's own communicator
    assert mixed.recipe == "weights=w8, grads=none"
    assert qsdp.Schedule().own_group(mixed.config())  # re-gathered weights: own communicator
    with pytest.raises(ValueError, match="unknown 'auto' weights option 'w3'"):
        _decision("w3", "none")
    with pytest.raises(ValueError, match="give weights and grads .FSDP2. or all_reduce"):
        replace(_all_reduce("cgx"), weights="w8")
    with pytest.raises(ValueError, match="grads='tl'. reduces over two levels: give levels"):
        _decision("wd4", "tl")


@pytest.mark.parametrize(
    "decision",
    [
        _decision("wd4", "tl", levels=True),
        _decision("none", "g8"),
        _all_reduce("bf16", pipeline_off="auto chose the uncompressed all-reduce (bf16)"),
        _all_reduce("cgx", pipeline=True),
        _all_reduce("bf16", measured=replace(SOCKET, world=1, bytes_per_s=float("inf"))),
    ],
    ids=["two-levels", "fsdp", "pipeline-off", "pipelined", "no-link"],
)
def test_a_resumed_run_rebuilds_the_decision_from_its_record(decision):
    record = json.loads(json.dumps(decision.record()))  # what config.json keeps
    again = AutoDecision.from_record(record)
    assert again == decision and again.config() == decision.config()
    assert again.record() == record
    # a record read back: the keys a caller added (the trainer's --redecide) are not read
    assert AutoDecision.from_record(record | {"previous": {"recipe": "bf16"}}) == decision
    assert record["recipe"] == decision.recipe and record["two_level"] == decision.two_level
    with pytest.raises(ValueError, match=r"lacks \['wire_bytes'\].*older qsdp"):
        AutoDecision.from_record({k: v for k, v in record.items() if k != "wire_bytes"})
    # the checkpoint's entry: one fixed-size tensor whatever the decision
    entry = state_entry(decision)
    assert entry.shape == state_entry(None).shape and entry.dtype == torch.uint8
    assert saved_decision({"auto": entry}) == decision
    assert saved_decision({"auto": state_entry(None)}) is None and saved_decision({}) is None


def test_loading_another_decisions_state_names_both():
    tl, g4 = _decision("wd4", "tl", levels=True), _decision("wd4", "g4")
    sdp4bit = qsdp.recipe("sdp4bit")
    entry = state_entry(tl)
    check_state_entry(entry, decision=tl, config=sdp4bit)  # the same choice
    check_state_entry(entry, decision=None, config=sdp4bit)  # rebuilt from the record
    check_state_entry(state_entry(None), decision=g4, config=sdp4bit)  # a named recipe's
    check_state_entry(None, decision=g4, config=sdp4bit)  # a state without the entry
    # the same config over one level instead of two: other collectives
    both = (
        r"chose sdp4bit \(two levels, 2 x 2\) \(weights=wd4, grads=tl\); "
        r"this model's 'auto' chose sdp4bit \(weights=wd4, grads=g4\)"
    )
    with pytest.raises(ValueError, match=both):
        check_state_entry(entry, decision=g4, config=sdp4bit)
    with pytest.raises(ValueError, match=r"grads=tl\); this model runs qsdp-w8g8: "):
        check_state_entry(entry, decision=None, config=qsdp.recipe("qsdp-w8g8"))


def test_two_levels_compress_the_slow_level_and_leave_the_fast_one_to_8_bits():
    # 2 nodes of 2 GPUs: NVLink inside a node, sockets between; the shard group's gathers run
    # at its slowest hop's speed
    inter = Measured(latency_s=200e-6, bytes_per_s=3e9, codec_s_per_element=CODEC, world=2)
    intra = Measured(latency_s=20e-6, bytes_per_s=300e9, codec_s_per_element=CODEC, world=2)
    assert choose_fsdp(predict_fsdp(GPT_1_4B, SOCKET, levels=(inter, intra))) == ("wd4", "tl")
    # between the nodes two levels send half the bytes of one-level 4-bit codes (a quarter of
    # the payload instead of a half); the 8-bit codec inside the node costs part of the gain
    p = predict_fsdp(GPT_1_4B, SOCKET, levels=(inter, intra), wire_exposed=1.0)
    assert p["grads"]["tl"] < 0.85 * p["grads"]["g4"]
    # all-slow levels: two levels still send every element at 8 bits, once more: one level wins
    slow_intra = Measured(latency_s=200e-6, bytes_per_s=3e9, codec_s_per_element=CODEC, world=2)
    assert choose_fsdp(predict_fsdp(GPT_1_4B, SOCKET, levels=(inter, slow_intra)))[1] == "g4"
    with pytest.raises(ValueError, match="levels of 2 x 2 ranks do not make the shard group's 8"):
        predict_fsdp(GPT_1_4B, replace(SOCKET, world=8), levels=(inter, intra))


def _two_level_auto(rank: int, world: int, intra_gbps: float, path: str) -> tuple:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from qsdp.policy import auto

    from ..models import classifier, train

    def cluster(intra_gbps: float):
        def fake_measure(group, device, **kw):  # a 2x2 cluster: sockets, NVLink (or not) inside
            ranks = sorted(torch.distributed.get_process_group_ranks(group))
            # each group sees its own link: node 1 is slower inside, one inter pair slower too,
            # so only an agreement over the whole shard group makes every rank choose alike
            gbps = {(0, 1): intra_gbps, (2, 3): intra_gbps / 3, (0, 2): 3.0, (1, 3): 2.0}
            bw = gbps.get(tuple(ranks), 3.0) * 1e9
            n = len(ranks)
            return Measured(latency_s=0.0, bytes_per_s=bw, codec_s_per_element=CODEC, world=n)

        return fake_measure

    auto.measure = cluster(intra_gbps)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("inter", "intra"))

    def build(config, mesh):
        model = classifier()
        for i in (2, 5):
            fully_shard(model[i])
        fully_shard(model)
        return qsdp.compress_fsdp(model, config, mesh=mesh)

    model = build("auto", mesh)
    decision = qsdp.fsdp.comm_state(model).decision
    # the two levels priced by the plan that runs them over this mesh
    shards = [sum(s.elements for s in g.slots) for g in qsdp.fsdp.fsdp_groups(model) if g.slots]
    plan = qsdp.recipe("sdp4bit").grads.plan(mesh=mesh)
    tl = sum(plan.reduce_scatter_wire_bytes(4 * k, 4) for k in shards)
    assert decision.wire_bytes["grads"]["tl"] == tl
    # what runs is the chosen config on the mesh (two levels) or without it (one level)
    ref = build(decision.config(), mesh if decision.two_level else None)
    losses, ref_losses = train(model, rank, 3), train(ref, rank, 3)
    assert losses == ref_losses
    got, want = qsdp.fsdp_comm_stats(model), qsdp.fsdp_comm_stats(ref)
    assert got.snapshot() == want.snapshot() and got.total_bytes > 0
    # the checkpoint keeps the decision; a resumed run (the config rebuilt from the record)
    # loads it, through torch.distributed.checkpoint on gloo too
    state = qsdp.fsdp.comm_state(model).state_dict()
    assert auto.saved_decision(state) == decision
    qsdp.fsdp.comm_state(ref).load_state_dict(state)
    dcp.save({"qsdp": qsdp.fsdp.comm_state(model)}, checkpoint_id=path)
    loaded = qsdp.fsdp.comm_state(ref).state_dict()
    dcp.load({"qsdp": loaded}, checkpoint_id=path)
    assert auto.saved_decision(loaded) == decision
    dcp.load({"qsdp": qsdp.fsdp.comm_state(ref)}, checkpoint_id=path)
    # a run that measured the other regime chose the same config over the other number of
    # levels: its collectives differ, and loading says what each chose
    auto.measure = cluster(3.0 if decision.two_level else 300.0)
    other = build("auto", mesh)
    assert qsdp.fsdp.comm_state(other).decision.grads != decision.grads
    with pytest.raises(ValueError) as raised:
        dcp.load({"qsdp": qsdp.fsdp.comm_state(other)}, checkpoint_id=path)
    gbps = tuple(round(v.bytes_per_s / 1e9, 3) for v in decision.levels)
    return decision.weights, decision.grads, decision.recipe, *gbps, str(raised.value)


@pytest.mark.parametrize(("intra_gbps", "grads"), [(300.0, "tl"), (3.0, "g4")])
def test_auto_on_a_two_level_mesh_runs_and_checkpoints_what_it_chose(intra_gbps, grads, tmp_path):
    results = run_distributed(_two_level_auto, 4, intra_gbps, str(tmp_path / "ckpt"))
    assert len(set(results)) == 1
    weights, chose, name, inter_gbps, intra_gbps, error = results[0]
    assert (weights, chose) == ("wd4", grads)
    assert (inter_gbps, intra_gbps) == (2.0, 100.0 if grads == "tl" else 1.0)  # the slowest
    assert name == ("sdp4bit (two levels, 2 x 2)" if grads == "tl" else "sdp4bit")
    other = "g4" if grads == "tl" else "tl"
    assert f"whose 'auto' chose {name} (weights=wd4, grads={grads}); this model's 'auto' " in error
    assert f"(weights=wd4, grads={other}): the collectives' state would not fit" in error


def test_one_level_codes_cross_the_slow_level_of_a_two_level_mesh():
    # 4x H100 in the 2x2 regime (benchmarks/results/auto_2026-11-26/run3_h100): the shard
    # group's ring measured 6.3 GB/s, the inter-node level 2.0 GB/s, NVLink inside 549 GB/s;
    # the step took 0.379 s with two levels and 0.469 s with one level of 4-bit codes
    shard = Measured(latency_s=140e-6, bytes_per_s=6.28e9, codec_s_per_element=CODEC, world=4)
    inter = Measured(latency_s=140e-6, bytes_per_s=1.97e9, codec_s_per_element=CODEC, world=2)
    intra = Measured(latency_s=20e-6, bytes_per_s=548.5e9, codec_s_per_element=CODEC, world=2)
    p = predict_fsdp(GPT_1_4B, shard, levels=(inter, intra))
    assert choose_fsdp(p) == ("wd4", "tl")
    assert p["grads"]["tl"] < p["grads"]["g4"] < p["grads"]["g8"] < p["grads"]["none"]
    # half of a one-level all-to-all's bytes leave the node; two levels send a quarter
    flat = predict_fsdp(GPT_1_4B, shard)
    assert p["grads"]["g4"] > flat["grads"]["g4"]  # the ring's figure flattered it
    assert p["grads"]["none"] == flat["grads"]["none"]  # NCCL's own ring: measured as a ring


def test_the_mixed_precision_dtypes_set_what_uncompressed_costs():
    fp32_reduce = predict_fsdp(GPT_1_4B, SOCKET)  # bf16 gathers, fp32 reduce: the defaults
    bf16_reduce = predict_fsdp(GPT_1_4B, SOCKET, reduce_bytes=2)
    fp32_params = predict_fsdp(GPT_1_4B, SOCKET, compute_bytes=4, reduce_bytes=4)
    # the uncompressed collectives carry the dtype's bytes (their latencies stay: one reduce-
    # scatter and two gathers per group); the codes do not depend on it
    lat_g, lat_w = (k * len(GPT_1_4B) * SOCKET.latency_s * WIRE_EXPOSED for k in (1, 2))
    assert bf16_reduce["grads"]["none"] - lat_g == pytest.approx(
        (fp32_reduce["grads"]["none"] - lat_g) / 2
    )
    assert fp32_params["weights"]["none"] - lat_w == pytest.approx(
        2 * (fp32_reduce["weights"]["none"] - lat_w)
    )
    for option in ("g8", "g4"):
        assert bf16_reduce["grads"][option] == fp32_reduce["grads"][option]
    # one dtype per group: two groups, each its own
    mixed = predict_fsdp([1 << 20, 1 << 20], SOCKET, reduce_bytes=[4, 2])
    halves = [predict_fsdp([1 << 20], SOCKET, reduce_bytes=b)["grads"]["none"] for b in (4, 2)]
    assert mixed["grads"]["none"] == pytest.approx(sum(halves))
    with pytest.raises(ValueError, match=r"reduce_bytes=\[4\]: give the bytes per element"):
        predict_fsdp([1, 2], SOCKET, reduce_bytes=[4])
    with pytest.raises(ValueError, match="compute_bytes=0"):
        predict_fsdp([1], SOCKET, compute_bytes=0)
    # DDP: bf16 gradients halve the uncompressed all-reduce, not the codes'
    fp32, bf16 = (predict_ddp(124_000_000, SOCKET, buckets=20, element_size=b) for b in (4, 2))
    latency = 20 * 2 * SOCKET.latency_s * WIRE_EXPOSED  # two collectives a bucket: not halved
    assert bf16["bf16"] - latency == pytest.approx((fp32["bf16"] - latency) / 2)
    assert bf16["cgx"] == fp32["cgx"] and bf16["global-qsgd"] == fp32["global-qsgd"]


def _policy_dtypes(rank: int, world: int) -> tuple:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    from qsdp.policy import auto

    from ..models import classifier

    seen = []
    fsdp, ddp = auto.decide_fsdp, auto.decide_all_reduce

    def record_fsdp(group, device, **kw):
        seen.append((kw["compute_bytes"], kw["reduce_bytes"]))
        return fsdp(group, device, **kw)

    def record_ddp(group, device, **kw):
        seen.append(kw["element_size"])
        return ddp(group, device, **kw)

    auto.decide_fsdp, auto.decide_all_reduce = record_fsdp, record_ddp
    init_device_mesh("cpu", (world,))
    bf16 = torch.bfloat16
    for mp in (
        None,
        MixedPrecisionPolicy(param_dtype=bf16),
        MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=torch.float32),
    ):
        model = classifier()
        kw = {} if mp is None else {"mp_policy": mp}
        for i in (2, 5):
            fully_shard(model[i], **kw)
        fully_shard(model, **kw)
        qsdp.compress_fsdp(model, "auto")
    qsdp.ddp.register(DDP(classifier().to(bf16)), "auto")
    return seen


def test_auto_reads_the_bytes_fsdp2_and_ddp_send_from_the_model():
    for seen in run_distributed(_policy_dtypes, 2):
        # three FSDP2 groups each (the two blocks and the root's embedding and norm)
        assert seen == [([4] * 3, [4] * 3), ([2] * 3, [2] * 3), ([2] * 3, [4] * 3), 2]


def test_the_report_tables_each_option_and_names_the_choice():
    decision = _decision("wd4", "tl", levels=True)
    chosen = (decision.predicted_s["weights"]["wd4"] + decision.predicted_s["grads"]["tl"]) * 1e3
    plain = sum(opts["none"] for opts in decision.predicted_s.values()) * 1e3
    text = decision.report()
    assert text.startswith("qsdp auto: 4 ranks, link 3.00 GB/s bus, latency 200 us (inter-node")
    assert (
        f"chose sdp4bit (two levels, 2 x 2) [weights wd4, grads tl]: {chosen:.1f} ms of exposed "
        f"communication per step against {plain:.1f} ms uncompressed"
    ) in text
    rows = [line.split() for line in text.splitlines()[2:-1]]  # collective, option, MB, ms, ms
    assert len(rows) == 3 + 4 and {r[0] for r in rows} == {"weights", "grads"}
    wd4 = next(r for r in rows if r[1] == "*wd4")
    assert float(wd4[2]) == pytest.approx(decision.wire_bytes["weights"]["wd4"] / 1e6, abs=1e-3)
    assert "pipeline" not in text
    ddp = _all_reduce("bf16", pipeline_off="auto chose the uncompressed all-reduce (bf16)")
    text = ddp.report()
    assert f"chose bf16: {ddp.predicted_s['all_reduce']['bf16'] * 1e3:.1f} ms" in text
    assert text.endswith("pipeline=True turned off: auto chose the uncompressed all-reduce (bf16)")


def _auto_pipeline(rank: int, world: int, link: Measured) -> tuple:
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    from qsdp.policy import auto

    from ..models import batch, classifier

    auto.measure = lambda group, device, **kw: replace(link, world=world)
    ddp = DDP(classifier())
    # pipelined when it compresses
    hook = qsdp.ddp.register(ddp, "auto", schedule=qsdp.Schedule(pipeline=True))
    x, y = batch(rank, 0)
    nn.functional.cross_entropy(ddp(x), y).backward()  # it trains either way
    # compressed HSDP (2 nodes of 1): the same rule
    mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("replicate", "shard"))
    model = classifier()
    for i in (2, 5):
        fully_shard(model[i], mesh=mesh["shard"])
    fully_shard(model, mesh=mesh["shard"])
    qsdp.compress_fsdp(
        model, "auto", replicate=mesh["replicate"], schedule=qsdp.Schedule(pipeline=True)
    )
    nn.functional.cross_entropy(model(x), y).backward()
    decision = qsdp.fsdp.comm_state(model).decision
    hooks = qsdp.fsdp._state._installed(model).hooks
    seconds = {getattr(h, "second_group", None) is not None for h in hooks}
    return (
        hook.decision.recipe,
        hook.second_group is not None,
        hook.decision.pipeline,
        hook.decision.pipeline_off,
        decision.recipe,
        decision.pipeline,
        seconds,
    )


def test_auto_pipelines_only_what_it_compresses_and_says_so():
    off = "auto chose the uncompressed all-reduce (bf16): nothing to pipeline"
    fast = run_distributed(_auto_pipeline, 2, NVLINK)
    assert all(r == ("bf16", False, False, off, "bf16", False, {False}) for r in fast), fast
    # (the test model is small: only a very slow link makes its bytes worth compressing)
    crawl = Measured(latency_s=0.0, bytes_per_s=1e6, codec_s_per_element=CODEC, world=2)
    slow = run_distributed(_auto_pipeline, 2, crawl)
    assert all(r[0] != "bf16" and r[1:4] == (True, True, None) for r in slow), slow
    assert all(r[4] != "bf16" and r[5] and r[6] == {True} for r in slow), slow
