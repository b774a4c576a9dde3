"""recipe="auto": the cost model keeps compression off a fast link and turns it on over a slow
one (measured numbers injected), and the measurement is the same on every rank."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from qsdp.fsdp.api import auto_config
from qsdp.policy.auto import (
    WIRE_EXPOSED,
    Measured,
    choose,
    choose_fsdp,
    measure,
    predict_ddp,
    predict_fsdp,
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
    import qsdp.policy.auto as auto

    clock = iter([0.0, 9.0, 10.0, 10.001, 20.0, 23.0, 30.0, 30.5, 40.0, 47.0])
    monkeypatch.setattr(auto.time, "perf_counter", lambda: next(clock))
    calls = []
    assert auto._timed(lambda: calls.append(1), torch.device("cpu")) == pytest.approx(0.001)
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


def _integrations(rank: int, world: int) -> tuple:
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    import qsdp

    from ..models import batch, classifier

    init_device_mesh("cpu", (world,))
    model = classifier()
    for i in (2, 5):
        fully_shard(model[i])
    fully_shard(model)
    qsdp.compress_fsdp(model, "auto")
    state = qsdp.fsdp.comm_state(model)
    choice = state.decision["recipe"]
    # what runs is what was chosen, per collective
    assert state.config == qsdp.fsdp.api.auto_config(state.decision)
    assert set(state.decision["predicted_s"]) == {"weights", "grads"}
    if (state.decision["weights"], state.decision["grads"]) == ("none", "none"):
        assert choice == "bf16"
    x, y = batch(rank, 0)
    nn.functional.cross_entropy(model(x), y).backward()  # it trains
    ddp = DDP(classifier())
    hook = qsdp.ddp.register(ddp, "auto")
    assert hook.config == qsdp.recipe(hook.decision["recipe"])
    nn.functional.cross_entropy(ddp(x), y).backward()
    return choice, hook.decision["recipe"]


def test_auto_in_compress_fsdp_and_ddp_agrees_on_every_rank():
    choices = run_distributed(_integrations, 2)
    assert len(set(choices)) == 1, choices


def _hsdp(rank: int, world: int) -> str:
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import qsdp

    from ..models import batch, classifier

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = classifier()
    for i in (2, 5):
        fully_shard(model[i], mesh=mesh["shard"])
    fully_shard(model, mesh=mesh["shard"])
    qsdp.compress_fsdp(model, "auto", replicate=mesh["replicate"])
    decision = qsdp.fsdp.comm_state(model).decision
    # the all-reduce options across the nodes, measured on the replicate group (2 ranks)
    assert set(decision["predicted_s"]) == {"bf16", "cgx", "qsdp-g8", "global-qsgd"}
    assert decision["measured"].world == 2
    x, y = batch(rank, 0)
    nn.functional.cross_entropy(model(x), y).backward()
    return decision["recipe"]


def test_auto_for_compressed_hsdp_decides_the_replicate_all_reduce():
    assert len(set(run_distributed(_hsdp, 4))) == 1


def test_auto_config_rebuilds_the_named_recipes_from_their_parts():
    import qsdp

    assert auto_config({"weights": "wd4", "grads": "g4", "recipe": "x"}) == qsdp.recipe("sdp4bit")
    assert auto_config({"weights": "w8", "grads": "g8", "recipe": "x"}) == qsdp.recipe("qsdp-w8g8")
    assert auto_config({"weights": "none", "grads": "none", "recipe": "x"}) == qsdp.recipe("bf16")
    assert auto_config({"recipe": "cgx"}) == qsdp.recipe("cgx")  # DDP, HSDP: a named recipe
    with pytest.raises(ValueError, match="unknown 'auto' weights option 'w3'"):
        auto_config({"weights": "w3", "grads": "none", "recipe": "x"})


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


def _two_level_auto(rank: int, world: int, intra_gbps: float) -> tuple:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import qsdp
    from qsdp.policy import auto

    from ..models import classifier, train

    def fake_measure(group, device, **kw):  # a 2x2 cluster: sockets, NVLink (or not) inside
        ranks = sorted(torch.distributed.get_process_group_ranks(group))
        # each group sees its own link: node 1 is slower inside, one inter pair slower too,
        # so only an agreement over the whole shard group makes every rank choose alike
        gbps = {(0, 1): intra_gbps, (2, 3): intra_gbps / 3, (0, 2): 3.0, (1, 3): 2.0}
        bw = gbps.get(tuple(ranks), 3.0) * 1e9
        return Measured(latency_s=0.0, bytes_per_s=bw, codec_s_per_element=CODEC, world=len(ranks))

    auto.measure = fake_measure
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("inter", "intra"))

    def build(config, mesh):
        model = classifier()
        for i in (2, 5):
            fully_shard(model[i])
        fully_shard(model)
        return qsdp.compress_fsdp(model, config, mesh=mesh)

    model = build("auto", mesh)
    decision = qsdp.fsdp.comm_state(model).decision
    two = decision["grads"] == "tl"
    # what runs is the chosen config on the mesh (two levels) or without it (one level)
    ref = build(auto_config(decision), mesh if two else None)
    losses, ref_losses = train(model, rank, 3), train(ref, rank, 3)
    assert losses == ref_losses
    got, want = qsdp.fsdp_comm_stats(model), qsdp.fsdp_comm_stats(ref)
    assert got.snapshot() == want.snapshot() and got.total_bytes > 0
    return decision["weights"], decision["grads"], decision["recipe"], *decision["levels_gb_per_s"]


@pytest.mark.parametrize(("intra_gbps", "grads"), [(300.0, "tl"), (3.0, "g4")])
def test_auto_on_a_two_level_mesh_runs_what_it_chose(intra_gbps, grads):
    results = run_distributed(_two_level_auto, 4, intra_gbps)
    assert len(set(results)) == 1
    weights, chose, name, inter_gbps, intra_gbps = results[0]
    assert (weights, chose) == ("wd4", grads)
    assert (inter_gbps, intra_gbps) == (2.0, 100.0 if grads == "tl" else 1.0)  # the slowest
    assert name == ("sdp4bit (two levels, 2 x 2)" if grads == "tl" else "sdp4bit")


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

    import qsdp
    from qsdp.policy import auto

    from ..models import classifier

    seen = []
    predict, decide = auto.predict_fsdp, auto.decide_all_reduce

    def record_fsdp(shards, m, **kw):
        seen.append((kw["compute_bytes"], kw["reduce_bytes"], kw.get("wire_exposed")))
        return predict(shards, m, **kw)

    def record_ddp(group, device, **kw):
        seen.append(kw["element_size"])
        return decide(group, device, **kw)

    auto.predict_fsdp, auto.decide_all_reduce = record_fsdp, record_ddp
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
        # three FSDP2 groups each (the two blocks and the root's embedding and norm), predicted
        # as the decision counts the wire (half) and as the serial check does (all of it)
        fsdp = [([4] * 3, [4] * 3), ([2] * 3, [2] * 3), ([2] * 3, [4] * 3)]
        assert seen == [(*b, e) for b in fsdp for e in (None, 1.0)] + [2]


def test_the_report_names_the_choice_and_its_predicted_communication():
    from qsdp.policy.auto import report

    fsdp = predict_fsdp(GPT_1_4B, SOCKET)
    weights, grads = choose_fsdp(fsdp)
    line = report(SOCKET, fsdp, "sdp4bit", options={"weights": weights, "grads": grads})
    chosen = (fsdp["weights"][weights] + fsdp["grads"][grads]) * 1e3
    plain = (fsdp["weights"]["none"] + fsdp["grads"]["none"]) * 1e3
    assert (
        f"chose sdp4bit: {chosen:.1f} ms of communication per step against {plain:.1f} ms" in line
    )
    ddp = predict_ddp(124_000_000, SOCKET, buckets=20)
    line = report(SOCKET, ddp, "cgx")
    assert (
        f"chose cgx: {ddp['cgx'] * 1e3:.1f} ms" in line
        and f"{ddp['bf16'] * 1e3:.1f} ms unc" in line
    )


def _auto_pipeline(rank: int, world: int, link: Measured) -> tuple:
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    import qsdp
    from qsdp.policy import auto

    from ..models import batch, classifier

    auto.measure = lambda group, device, **kw: replace(link, world=world)
    ddp = DDP(classifier())
    hook = qsdp.ddp.register(ddp, "auto", pipeline=True)  # pipelined when it compresses
    x, y = batch(rank, 0)
    nn.functional.cross_entropy(ddp(x), y).backward()  # it trains either way
    # compressed HSDP (2 nodes of 1): the same rule
    mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("replicate", "shard"))
    model = classifier()
    for i in (2, 5):
        fully_shard(model[i], mesh=mesh["shard"])
    fully_shard(model, mesh=mesh["shard"])
    qsdp.compress_fsdp(model, "auto", replicate=mesh["replicate"], pipeline=True)
    nn.functional.cross_entropy(model(x), y).backward()
    state = qsdp.fsdp.comm_state(model)
    hooks = qsdp.fsdp._state._installed(model).hooks
    seconds = {getattr(h, "second_group", None) is not None for h in hooks}
    return (
        hook.decision["recipe"],
        hook.second_group is not None,
        hook.decision.get("pipeline"),
        state.decision["recipe"],
        seconds,
    )


def test_auto_pipelines_only_what_it_compresses():
    fast = run_distributed(_auto_pipeline, 2, NVLINK)
    assert all(r == ("bf16", False, False, "bf16", {False}) for r in fast), fast
    # (the test model is small: only a very slow link makes its bytes worth compressing)
    crawl = Measured(latency_s=0.0, bytes_per_s=1e6, codec_s_per_element=CODEC, world=2)
    slow = run_distributed(_auto_pipeline, 2, crawl)
    assert all(r[0] != "bf16" and r[1:3] == (True, None) for r in slow), slow
    assert all(r[3] != "bf16" and r[4] == {True} for r in slow), slow
