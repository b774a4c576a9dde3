import pytest
import torch

from qsdp.policy import ParamPolicy


def test_defaults_keep_small_and_1d_tensors_exact():
    p = ParamPolicy()
    assert not p.compresses("ln.weight", (4096,))  # 1-D
    assert not p.compresses("tiny.weight", (16, 32))  # 512 < 1024 elements
    assert p.compresses("fc.weight", (32, 32))  # 1024 elements, 2-D
    assert ParamPolicy(keep_1d=False, min_numel=0).compresses("ln.weight", (8,))
    named = ParamPolicy(uncompressed=("emb.*", "*.head.weight"))
    assert not named.compresses("emb.weight", (50304, 2048))
    assert not named.compresses("model.head.weight", (64, 64))
    assert named.compresses("blocks.0.fc.weight", (64, 64))


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [({"min_numel": -1}, ValueError), ({"uncompressed": "emb.*"}, TypeError)],
)
def test_bad_policy(kwargs, error):
    with pytest.raises(error):
        ParamPolicy(**kwargs)


def test_split_positions_follow_the_flat_layout():
    layout = [("a.weight", 6, (12, 8)), ("a.bias", 2, (4,)), ("b.weight", 5, (10, 200))]
    s = ParamPolicy(min_numel=0).split(layout)
    assert s.chunk == 13
    comp, raw = s.positions()
    assert comp.tolist() == [0, 1, 2, 3, 4, 5, 8, 9, 10, 11, 12]
    assert raw.tolist() == [6, 7] and s.raw_names == ("a.bias",)
    assert s.runs == ((0, 6, True), (6, 2, False), (8, 5, True))  # a few runs, no vectors
    assert ParamPolicy().split([("w", 4, (64, 64))]) is None  # all compressed: no split
    only_raw = ParamPolicy().split([("b", 3, (3,))])
    assert only_raw.n_comp == 0 and only_raw.positions()[1].tolist() == [0, 1, 2]
    assert torch.equal(torch.sort(torch.cat((comp, raw))).values, torch.arange(13))
    rows = torch.arange(26.0).view(2, 13)  # take / put round trip on [k, chunk] rows
    c, r = s.take(rows)
    assert torch.equal(c, rows[:, comp]) and torch.equal(r, rows[:, raw])
    back = torch.zeros_like(rows)
    s.put(back, c, r)
    assert torch.equal(back, rows)


def test_split_put_writes_every_rows_runs_from_contiguous_and_strided_parts():
    """put() into [k, chunk] rows (k = 3) from a contiguous compressed part and a raw part that
    is a column block of a wider payload (its rows apart), against the positions' reference; a
    part given as None leaves its runs as they were."""
    from qsdp.comm import Split

    s = Split.of([(5, True), (2, False), (7, True), (3, False), (4, True)])
    comp_pos, raw_pos = s.positions()
    k = 3
    comp = torch.arange(k * s.n_comp, dtype=torch.float32).view(k, s.n_comp) + 100
    payload = torch.arange(k * (s.n_raw + 4), dtype=torch.float32).view(k, -1) - 100
    raw = payload[:, 2 : 2 + s.n_raw]  # rows apart: stride (n_raw + 4, 1)
    assert not raw.is_contiguous()
    rows = torch.full((k, s.chunk), -1.0)
    s.put(rows, comp, raw)
    assert torch.equal(rows[:, comp_pos], comp) and torch.equal(rows[:, raw_pos], raw)
    kept = torch.full((k, s.chunk), -1.0)
    s.put(kept, None, raw)
    assert torch.equal(kept[:, raw_pos], raw) and bool((kept[:, comp_pos] == -1).all())
    s.put(kept[:0], comp[:0], raw[:0])  # no rows: nothing to write
