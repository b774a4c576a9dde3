import torch

from qsdp.quant.philox import _M0, _M1, _mulhilo, philox4x32, philox_rounds, random_signs, uniform


def _t(v):
    return torch.tensor([v], dtype=torch.int64)


def test_known_answers_of_random123():
    # Known-answer vectors of Philox4x32-10 published with Random123.
    out = philox_rounds(_t(0), _t(0), _t(0), _t(0), 0, 0)
    assert [int(w) for w in out] == [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]
    m = 0xFFFFFFFF
    out = philox_rounds(_t(m), _t(m), _t(m), _t(m), m, m)
    assert [int(w) for w in out] == [0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD]
    out = philox_rounds(
        _t(0x243F6A88), _t(0x85A308D3), _t(0x13198A2E), _t(0x03707344), 0xA4093822, 0x299F31D0
    )
    assert [int(w) for w in out] == [0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1]


def test_mulhilo_is_the_exact_64_bit_product():
    # the words where an int64 product of two 32-bit words would overflow, and random ones
    edge = [0, 1, 2, 0xFFFF, 0x10000, 2**31 - 1, 2**31, 2**32 - 2, 2**32 - 1]
    rand = torch.randint(
        0, 2**32, (4096,), dtype=torch.int64, generator=torch.Generator().manual_seed(0)
    )
    x = torch.cat((torch.tensor(edge, dtype=torch.int64), rand))
    for m in (_M0, _M1, 2**32 - 1, 2**31, 2**31 - 1, 12345, 0):
        hi, lo = _mulhilo(m, x)
        want = [v * m for v in x.tolist()]
        assert hi.tolist() == [w >> 32 for w in want], m
        assert lo.tolist() == [w & 0xFFFFFFFF for w in want], m


def test_counter_words_layout():
    ctr = torch.tensor([5 + (7 << 32)])
    a = philox4x32(ctr, key=(11 << 32) | 13, stream=17, step=19)
    b = philox_rounds(_t(5), _t(7), _t(17), _t(19), 13, 11)
    assert [int(w) for w in a] == [int(w) for w in b]


def test_uniform_is_a_pure_function_of_the_index():
    full = uniform(1001, seed=3, step=4, stream=5)
    assert torch.equal(uniform(1001, seed=3, step=4, stream=5), full)
    assert torch.equal(uniform(500, seed=3, step=4, stream=5, offset=333), full[333:833])
    assert float(full.min()) > 0.0 and float(full.max()) < 1.0
    # 16-bit bin centres: (h + 0.5) / 2^16, exact in float32
    h = full * 2**16 - 0.5
    assert torch.equal(h, h.round())
    assert torch.equal(uniform(3, seed=3, step=4, stream=5, offset=998), full[998:1001])


def test_uniform_statistics_and_independence_of_keys():
    n = 200_000
    u = uniform(n, seed=1, step=0, stream=0)
    assert abs(float(u.mean()) - 0.5) < 5 * (1 / 12) ** 0.5 / n**0.5
    assert abs(float(u.var()) - 1 / 12) < 2e-3
    hist = torch.histc(u, bins=10, min=0, max=1)
    assert float((hist - n / 10).abs().max()) < 6 * (n / 10) ** 0.5
    for kw in ({"seed": 2}, {"step": 1}, {"stream": 1}):
        v = uniform(n, **({"seed": 1, "step": 0, "stream": 0} | kw))
        corr = torch.corrcoef(torch.stack((u, v)))[0, 1]
        assert abs(float(corr)) < 0.02


def test_random_signs_are_balanced_and_seeded():
    s = random_signs(256, seed=9)
    assert set(s.tolist()) == {-1.0, 1.0}
    assert abs(float(s.sum())) < 64
    assert torch.equal(s, random_signs(256, seed=9))
    assert not torch.equal(s, random_signs(256, seed=10))
