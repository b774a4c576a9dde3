"""Weight prediction's Triton kernel against its torch reference ([Note: the prediction in one
kernel] in ``qsdp.runtime.adam_step``): on CPU in Triton's interpreter (``TRITON_INTERPRET=1``,
set by conftest) and, marked ``gpu``, compiled on CUDA against torch's own fused step there."""

from __future__ import annotations

import pytest
import torch

from qsdp.runtime import adam_step

# lengths: one element, one under and one over a program's 2048, several programs and a tail
SHAPES = [(1,), (2047,), (3, 683), (4099,)]


def _adam_decoupled(params, **kw):
    return torch.optim.Adam(params, decoupled_weight_decay=True, **kw)


def _case(kind, weight_decay: float, device: str, dtype=torch.float32):
    """Parameters of ``SHAPES`` with two steps of ``kind`` taken (moments and steps set), their
    states and group, and random estimates (bf16, as the reductions keep them)."""
    g = torch.Generator().manual_seed(3)
    params = [torch.randn(s, generator=g).to(device, dtype) for s in SHAPES]
    params = [torch.nn.Parameter(p) for p in params]
    opt = kind(params, lr=1e-2, weight_decay=weight_decay, betas=(0.9, 0.95))
    for _ in range(2):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g).to(device, dtype)
        opt.step()
    estimates = [torch.randn(s, generator=g).to(device, torch.bfloat16) for s in SHAPES]
    xs = [p.detach() for p in params]
    return opt, xs, [opt.state[p] for p in params], estimates


def _step(opt, states, estimates, coef) -> adam_step.AdamStep:
    return adam_step.AdamStep(
        group=opt.param_groups[0],
        adamw=isinstance(opt, torch.optim.AdamW),
        estimates=estimates,
        states=states,
        clip_coef=coef,
    )


def _reference(opt, xs, states, estimates, coef) -> list[torch.Tensor]:
    new = adam_step.fp32_copies(xs)
    adam_step.predicted_into(new, _step(opt, states, estimates, coef))
    return new


@pytest.mark.parametrize("steps_here", [True, False])
@pytest.mark.parametrize("coef", [1.0, 0.37])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize("kind", [torch.optim.AdamW, torch.optim.Adam, _adam_decoupled])
def test_the_kernel_writes_the_reference_step_cast_where_it_goes(
    monkeypatch, kind, weight_decay, coef, steps_here
):
    """Both ways of reading the step counts ([Note: step counts read where they are]): by the
    kernel (every count on the parameters' device, as on this CPU) or by the host (forced)."""
    from qsdp.runtime import _adam_triton

    if not steps_here:
        monkeypatch.setattr(_adam_triton, "_steps_here", lambda steps, device: False)

    opt, xs, states, estimates = _case(kind, weight_decay, "cpu")
    moments = [(s["exp_avg"].clone(), s["exp_avg_sq"].clone()) for s in states]
    want = _reference(opt, xs, states, estimates, coef)
    step = _step(opt, states, estimates, coef)
    # float32 out (a gather's input under fp32 compute), and bf16 (under bf16 compute): flat
    # slices of one buffer, as a gather's input holds them
    for dtype, rtol in ((torch.float32, 1e-6), (torch.bfloat16, 2**-8)):
        flat = torch.full((sum(x.numel() for x in xs) + 5,), 7.0, dtype=dtype)
        outs, offset = [], 2
        for x in xs:
            outs.append(flat[offset : offset + x.numel()])
            offset += x.numel()
        _adam_triton.predict_into(outs, xs=xs, step=step)
        for out, w, x in zip(outs, want, xs, strict=True):
            w = w.reshape(-1).to(dtype).float()
            torch.testing.assert_close(out.float(), w, rtol=rtol, atol=1e-7)
            assert not torch.equal(out.float(), x.reshape(-1).to(dtype).float())  # it moved
        assert flat[:2].eq(7).all() and flat[offset:].eq(7).all()  # nothing written around
    for s, (m, v) in zip(states, moments, strict=True):  # the moments read, never written
        assert torch.equal(s["exp_avg"], m) and torch.equal(s["exp_avg_sq"], v)
    # in place: the parameter itself moved
    before = [x.clone() for x in xs]
    _adam_triton.predict_into(xs, xs=xs, step=step)
    for x, w, b in zip(xs, want, before, strict=True):
        torch.testing.assert_close(x, w, rtol=1e-6, atol=1e-7)
        assert not torch.equal(x, b)


def test_a_non_finite_estimate_predicts_nothing_in_the_kernel_and_its_reference():
    """[Note: a non-finite estimate predicts nothing]: NaN and infinite elements of an estimate
    step as a zero gradient would, in the kernel and in the reference, and nothing written is
    non-finite."""
    from qsdp.runtime import _adam_triton

    opt, xs, states, estimates = _case(torch.optim.AdamW, 0.1, "cpu")
    bad = [e.clone() for e in estimates]
    bad[1][5], bad[3][7], bad[3][4000] = float("nan"), float("inf"), float("-inf")
    zeroed = [torch.nan_to_num(e, nan=0.0, posinf=0.0, neginf=0.0) for e in bad]
    want = _reference(opt, xs, states, zeroed, 0.5)
    step = _step(opt, states, bad, 0.5)
    ref = adam_step.fp32_copies(xs)
    adam_step.predicted_into(ref, step)
    got = [torch.empty_like(x) for x in xs]
    _adam_triton.predict_into(got, xs=xs, step=step)
    for r, g, w in zip(ref, got, want, strict=True):
        assert torch.isfinite(r).all() and torch.isfinite(g).all()
        assert torch.equal(r, w)  # the reference: exactly the zeroed estimate's step
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-7)


def test_a_clip_coefficient_on_the_device_is_the_same_step_as_the_number():
    """[Note: a clipped prediction never reads the device]: a 0-d float32 coefficient, read by
    the kernel (and multiplied as a tensor by the reference), steps bit for bit as the same
    float32 value passed as a number; one of another dtype or size is refused."""
    from qsdp.runtime import _adam_triton

    opt, xs, states, estimates = _case(torch.optim.AdamW, 0.1, "cpu")
    coef = torch.tensor(0.37)  # (float32: the number's value as the kernel reads it)
    want = _reference(opt, xs, states, estimates, 0.37)
    assert all(
        torch.equal(r, w)
        for r, w in zip(_reference(opt, xs, states, estimates, coef), want, strict=True)
    )
    by_number = [torch.empty_like(x) for x in xs]
    _adam_triton.predict_into(by_number, xs=xs, step=_step(opt, states, estimates, 0.37))
    on_device = [torch.empty_like(x) for x in xs]
    _adam_triton.predict_into(on_device, xs=xs, step=_step(opt, states, estimates, coef))
    unclipped = [torch.empty_like(x) for x in xs]
    _adam_triton.predict_into(unclipped, xs=xs, step=_step(opt, states, estimates, 1.0))
    for a, b, c, w in zip(by_number, on_device, unclipped, want, strict=True):
        assert torch.equal(a, b)
        assert not torch.equal(b, c)  # (the coefficient was read)
        torch.testing.assert_close(b, w, rtol=1e-6, atol=1e-7)
    out = [torch.empty_like(x) for x in xs]
    with pytest.raises(ValueError, match="one-element float32 tensor"):
        _adam_triton.predict_into(out, xs=xs, step=_step(opt, states, estimates, coef.double()))


def test_the_kernel_runs_where_it_applies_and_the_reference_elsewhere():
    """On CPU the reference computes the step; on CUDA the kernel, for contiguous float32 /
    bf16 / fp16 tensors only."""
    opt, xs, states, estimates = _case(torch.optim.AdamW, 0.1, "cpu")
    assert not adam_step._kernel_applies(xs, xs, _step(opt, states, estimates, 1.0))
    if torch.cuda.is_available():
        opt, xs, states, estimates = _case(torch.optim.AdamW, 0.1, "cuda")
        assert adam_step._kernel_applies(xs, xs, _step(opt, states, estimates, 1.0))
        t = [xs[2].t()]
        assert not adam_step._kernel_applies(t, t, _step(opt, states[2:3], estimates[2:3], 1.0))
        wide = [x.double() for x in xs]
        assert not adam_step._kernel_applies(wide, wide, _step(opt, states, estimates, 1.0))
        on_cpu = torch.tensor(0.5)  # (a coefficient the kernel cannot read)
        assert not adam_step._kernel_applies(xs, xs, _step(opt, states, estimates, on_cpu))


def _fused_adamw(params, **kw):
    return torch.optim.AdamW(params, fused=True, **kw)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("kind", [torch.optim.AdamW, torch.optim.Adam, _fused_adamw])
def test_the_compiled_kernel_is_torchs_fused_step_on_cuda(kind):
    """Compiled, against torch's fused step on the same device (the reference's kernel):
    float32 within 1e-6, as the CPU test; the moments untouched."""
    opt, xs, states, estimates = _case(kind, 0.1, "cuda")
    want = _reference(opt, xs, states, estimates, 0.5)
    got = [torch.empty_like(x) for x in xs]
    adam_step.predict_step(got, xs=xs, step=_step(opt, states, estimates, 0.5))
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-7)


def test_one_launch_per_group_builds_its_table_once_per_layout():
    """[Note: one launch per group]: the offsets table is built at a layout's first call and
    found again when the next step's estimates and outputs are new buffers laid out alike; a
    new layout builds new offsets and keeps the grid of the same lengths. Every call computes
    the reference step."""
    from qsdp.quant._triton import tables
    from qsdp.runtime import _adam_triton

    opt, xs, states, estimates = _case(torch.optim.AdamW, 0.1, "cpu")
    total = sum(x.numel() for x in xs)

    def laid_out(flat: torch.Tensor, gap: int) -> list[torch.Tensor]:
        views, offset = [], gap
        for x in xs:
            views.append(flat[offset : offset + x.numel()].view(x.shape))
            offset += x.numel() + gap
        return views

    built = tables.plans_built
    for gap in (3, 3, 3, 8):  # three steps of one layout, then another
        ests = laid_out(torch.zeros(total + 5 * gap, dtype=torch.bfloat16), gap)
        for e, src in zip(ests, estimates, strict=True):
            e.copy_(src)
        flat = torch.zeros(total + 5 * gap)
        outs = [o.reshape(-1) for o in laid_out(flat, gap)]
        _adam_triton.predict_into(outs, xs=xs, step=_step(opt, states, ests, 1.0))
        want = _reference(opt, xs, states, estimates, 1.0)
        for o, w in zip(outs, want, strict=True):
            torch.testing.assert_close(o, w.reshape(-1), rtol=1e-6, atol=1e-7)
    assert tables.plans_built == built + 2
    # the grid's table (one entry per program) depends on the lengths alone: one for both layouts
    numels = tuple(x.numel() for x in xs)
    grids = [k for k in tables._tables if k[0] == "programs" and k[-1] == numels]
    assert len(grids) == 1, grids


def test_tensors_a_fraction_of_an_element_apart_are_refused():
    """The table holds whole elements: an estimate at an odd byte address beside others of its
    dtype at even ones cannot be reached from the set's first, and is refused by name."""
    from qsdp.runtime import _adam_triton

    opt, xs, states, estimates = _case(torch.optim.AdamW, 0.1, "cpu")
    n = estimates[1].numel()
    raw = bytearray(2 * n + 1)
    odd = torch.frombuffer(raw, dtype=torch.bfloat16, count=n, offset=1).view(estimates[1].shape)
    odd.copy_(estimates[1])
    assert odd.data_ptr() % 2 == 1
    bad = [estimates[0], odd, *estimates[2:]]
    out = [torch.empty_like(x) for x in xs]
    with pytest.raises(ValueError, match="a fraction of an element apart"):
        _adam_triton.predict_into(out, xs=xs, step=_step(opt, states, bad, 1.0))


@pytest.mark.parametrize("steps_here", [True, False])
def test_parameters_at_other_steps_or_dtypes_each_take_their_own_step(monkeypatch, steps_here):
    """A group whose parameters' optimizer steps differ (one added later) or whose dtypes
    differ: every parameter gets the reference's step from its own count, an empty one
    nothing. The counts are read by the kernel where they lie on the parameters' device (a
    fused or capturable optimizer's, [Note: step counts read where they are]; here, on the
    CPU, every count does) or on the host, which cuts the group into launches of one step
    each (forced here: on a GPU that is the default optimizer's case)."""
    from qsdp.runtime import _adam_triton

    if not steps_here:
        monkeypatch.setattr(_adam_triton, "_steps_here", lambda steps, device: False)

    opt, xs, states, estimates = _case(torch.optim.AdamW, 0.1, "cpu")
    late = torch.nn.Parameter(torch.randn(300))
    empty = torch.nn.Parameter(torch.randn(0))
    opt.add_param_group({"params": [late, empty]})
    late.grad, empty.grad = torch.randn(300), torch.randn(0)
    opt.step()  # the first group's third step, the late one's first
    group = opt.param_groups[0]
    xs = [*xs, late.detach(), empty.detach()]
    states = [*states, opt.state[late], opt.state[empty]]
    estimates = [*estimates, torch.randn(300).to(torch.bfloat16), torch.randn(0)]
    step = adam_step.AdamStep(
        group=group, adamw=True, estimates=estimates, states=states, clip_coef=1.0
    )
    assert {float(s["step"]) for s in states} == {1.0, 3.0}
    want = adam_step.fp32_copies(xs)
    adam_step.predicted_into(want, step)
    dtypes = [torch.bfloat16 if i % 2 else torch.float32 for i in range(len(xs))]
    outs = [torch.empty_like(x, dtype=d) for x, d in zip(xs, dtypes, strict=True)]
    _adam_triton.predict_into(outs, xs=xs, step=step)
    for o, w in zip(outs, want, strict=True):
        # (bf16: float32 values 1e-6 apart may round one bf16 step apart, 2^-7 at a binade's foot)
        rtol = 2**-7 if o.dtype == torch.bfloat16 else 1e-6
        torch.testing.assert_close(o.float(), w.to(o.dtype).float(), rtol=rtol, atol=1e-7)


@pytest.mark.parametrize("steps_here", [True, False])
def test_a_beta_of_zero_takes_the_reference_step(monkeypatch, steps_here):
    """Adam without momentum (``betas=(0.0, ...)``): the kernel's bias corrections from the
    step counts it reads take ``log(0)`` as -inf (``0^t = 0``), and the host's are ``1 - 0``: the
    reference step either way, and nothing non-finite."""
    from qsdp.runtime import _adam_triton

    if not steps_here:
        monkeypatch.setattr(_adam_triton, "_steps_here", lambda steps, device: False)
    g = torch.Generator().manual_seed(5)
    params = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in SHAPES]
    opt = torch.optim.AdamW(params, lr=1e-2, betas=(0.0, 0.99), weight_decay=0.1)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)
    opt.step()
    xs = [p.detach() for p in params]
    estimates = [torch.randn(s, generator=g) for s in SHAPES]
    step = _step(opt, [opt.state[p] for p in params], estimates, 1.0)
    want = _reference(opt, xs, step.states, estimates, 1.0)
    got = [torch.empty_like(x) for x in xs]
    _adam_triton.predict_into(got, xs=xs, step=step)
    for o, w in zip(got, want, strict=True):
        assert torch.isfinite(o).all()
        torch.testing.assert_close(o, w, rtol=1e-6, atol=1e-7)
