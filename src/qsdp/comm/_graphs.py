"""A collective's codec kernels captured once in CUDA graphs and replayed: constant host work.

[Note: codec segments replayed]
On a fast link the compressed FSDP2 step is bound by the host (issue 32): a quantized
reduce-scatter issues some 40 torch ops and Triton launches (the split's copies, the encode,
the raw bytes, the decode, the sum, the division), a quantized all-gather some 15, each a few
microseconds of Python and driver work: ~0.4-0.8 ms of host a reduce-scatter call on an H200
host against ~0.25 ms of kernels. The kernels of one call depend only on its shapes,
quantizer and noise key, so :class:`CodecGraphs` captures them: the encode segment (input
buffer -> send buffer) of each call site (a group's hook: shapes and noise key) and the decode
segment (receive buffer -> output buffer) of each shape are run eagerly at their first call
(that compiles the kernels and makes the constant tables they read), then captured in a
``torch.cuda.CUDAGraph`` each; every later call replays them. The exchange between them stays
an eager ``torch.distributed`` call on the same buffers: NCCL and the process group are used as
ever, and nothing is captured across ranks. What a call does besides: copy its input into the
captured input buffer, write its step into the captured step word, replay, exchange, replay,
copy the captured output to its output: four torch ops and two graph launches (measured on one
H200, ``benchmarks/codec_graphs.py``: a GPT block's reduce-scatter 0.36-0.80 ms of host eager,
0.07-0.14 ms replayed). That call is :meth:`ReplayedSite.run`, one for every replayed
collective (the reduce-scatter, the quantized all-gather, the weight-difference gather);
their sites, checked once, live in :attr:`CodecGraphs.sites`. A site whose decode writes
state of its own (the weight differences' reconstruction) keys that segment by the site too.

What makes a replay the eager call's bits:

- **the noise key**: the stochastic rounding's step is read by the encode kernel from one int64
  in device memory (``encode_rows(step=<tensor>)``), which each call fills; the seed and the
  noise streams (the rank's place, the bucket) are fixed per segment, part of its key;
- **fixed addresses**: the buffers (input, or a policy split's parts taken from it straight,
  send, receive, output, step) are allocated once per shape and shared by every segment of
  that shape: FSDP2 reduces its groups
  one after another on one stream, so the groups of a model with equal blocks share one set
  (the key holds the stream, so two streams never share one); the constant tables the kernels
  read (noise streams, run ends) are made once per process and never freed
  (``qsdp.quant._tables``);
- **nothing else read from the host**: the segments are launches of kernels on device buffers;
  the first, eager call is where a table is first copied to the device.

The cost: one capture per (shape, key) segment (milliseconds, at the first step), the buffers
(per shape and stream: the input or its split parts, the payloads, the output: a little more
than one group's gradient), and two copies per call (the input in, the output out: 3 bytes per
element of device memory traffic for bf16 in and out, ~0.05 ms for a 50 M-element GPT block's
reduce-scatter on an H200).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable
from typing import Any

import torch

__all__ = ["CodecGraphs", "ReplayedSite", "check_replayable", "gather_buffers"]


def check_replayable(what: str, *, async_op: bool, spec: Any, backend: str) -> None:
    """Raise unless a call of collective ``what`` can be replayed: synchronous, with a spec that
    propagates NaN/Inf (the caller checks them: no host read between the segments), on the
    Triton backend (the kernels the graphs hold)."""
    if async_op or spec.propagating() is not spec or backend == "reference":
        raise ValueError(
            f"{what}(graphs=...) replays CUDA graphs of the Triton kernels: it needs a "
            "synchronous call and a spec with nonfinite='propagate' (the caller checks "
            f"NaN/Inf); got async_op={async_op}, spec.nonfinite={spec.nonfinite.value!r}, "
            f"backend={backend!r}: pass graphs=None"
        )


def gather_buffers(
    *, m: int, row: int, n: int, dtype: torch.dtype, device: torch.device
) -> dict[str, torch.Tensor]:
    """What every replayed gather's segments read and write: its input (``m`` elements of
    ``dtype``), the payload row it sends (``row`` bytes), the ``n`` rows it receives and the
    step word the encode reads."""
    return {
        "inp": torch.empty(m, dtype=dtype, device=device),
        "send": torch.empty(row, dtype=torch.uint8, device=device),
        "recv": torch.empty(n * row, dtype=torch.uint8, device=device),
        "step": torch.zeros(1, dtype=torch.int64, device=device),
    }


class CodecGraphs:
    """One model's captured codec segments and the buffers they read and write.

    A hook passes one to a collective (``reduce_scatter(graphs=...)``) to have its encode and
    decode replayed ([Note: codec segments replayed]). Not thread-safe; one per model.

    Args:
        capture: False runs every segment eagerly on the same buffers, captures nothing (any
            device: what the CPU tests check of the buffers and keys; no host work saved), and
            counts in :attr:`captured` and :attr:`replayed` what a capture would have done.
    """

    def __init__(self, *, capture: bool = True) -> None:
        self.capture = capture
        self._buffers: dict[Hashable, Any] = {}
        self.sites: dict[Hashable, Any] = {}
        """A collective's call sites, worked out at their first call (its own key and type)."""
        self._graphs: dict[Hashable, torch.cuda.CUDAGraph | None] = {}
        self._side: dict[torch.device, torch.cuda.Stream] = {}
        self.captured = 0
        """Segments captured so far (one per (shape, key) and side: encode or decode); without
        ``capture``, the segments a capture would have captured."""
        self.replayed = 0
        """Segment replays so far (without ``capture``: the later runs of a segment's key)."""

    @staticmethod
    def check_parameters(params: Iterable[torch.Tensor]) -> None:
        """Raise unless a model's ``params`` are all on CUDA (what ``Schedule(graphs=True)``
        replays: FSDP2's and DDP's installers check it before anything is made)."""
        devices = {p.device.type for p in params}
        if devices != {"cuda"}:
            raise ValueError(
                f"Schedule(graphs=True) replays CUDA graphs; the model's parameters are on "
                f"{sorted(devices)}: drop graphs off CUDA"
            )

    def site(
        self,
        name: str,
        *,
        group: Any,
        input: torch.Tensor,
        output: torch.Tensor,
        layout: tuple,
        noise: tuple,
        make: Callable[[tuple], Any],
    ) -> Any:
        """Collective ``name``'s call site for this call (made by ``make(shape key)`` at its
        first call): one per group, current stream, input and output shape and dtype,
        ``layout`` (quantizer, split, op) and ``noise`` (seed, bucket). The shape key, without
        the noise, is what its buffers and decode are shared by."""
        if self.capture and not input.is_cuda:
            raise ValueError(
                f"{name}(graphs=...): input on {input.device}; a capture needs CUDA tensors: "
                "pass graphs=None off CUDA (CodecGraphs(capture=False) runs the segments eagerly)"
            )
        stream = torch.cuda.current_stream(input.device).stream_id if input.is_cuda else 0
        key = (name, group, input.device, stream, input.numel(), input.dtype, output.dtype)
        key += layout
        found = self.sites.get((key, noise))
        if found is None:
            found = self.sites[key, noise] = make(key)
        return found

    def buffers(self, key: Hashable, make: Callable[[], Any]) -> Any:
        """The buffers of shape ``key`` (made by ``make()`` the first time): the same objects on
        every call, so a captured segment finds them where it was captured."""
        found = self._buffers.get(key)
        if found is None:
            found = self._buffers[key] = make()
        return found

    def run(self, key: Hashable, body: Callable[[], None]) -> None:
        """The kernels ``body()`` launches, on the current stream: at the first call with
        ``key`` run eagerly, then captured (not run again); replayed at every later call.
        ``body`` must launch the same kernels on the same buffers every time it is called with
        ``key`` and read nothing from the host (a table it reads is made by its eager run)."""
        if not self.capture:  # eagerly, counted as a capture would count it
            body()
            if key in self._graphs:
                self.replayed += 1
            else:
                self._graphs[key] = None
                self.captured += 1
            return
        graph = self._graphs.get(key)
        if graph is not None:
            graph.replay()
            self.replayed += 1
            return
        body()
        graph = torch.cuda.CUDAGraph()
        current = torch.cuda.current_stream()
        side = self._side.get(current.device)
        if side is None:  # a capture needs a stream other than the legacy default one
            side = self._side[current.device] = torch.cuda.Stream(current.device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            # thread_local: a capture on this thread does not forbid the CUDA work of others
            # (an optimizer thread, a data loader's pinned copies)
            graph.capture_begin(capture_error_mode="thread_local")
            try:
                body()
            finally:
                graph.capture_end()
        current.wait_stream(side)
        self._graphs[key] = graph
        self.captured += 1


class ReplayedSite:
    """One call site of a replayed collective (a group's hook): what every call does, the same
    for each collective ([Note: codec segments replayed]). A collective's site gives its
    captured buffers (``inp``, ``out``, ``step``: shared by the sites of its shape), its two
    segments (:meth:`encode`, :meth:`decode`: kernels on those buffers only) and its exchange
    (:meth:`exchange`, eager, between them)."""

    def __init__(
        self,
        graphs: CodecGraphs,
        key: tuple,
        noise: tuple,
        *,
        inp: torch.Tensor | None,
        out: torch.Tensor,
        step: torch.Tensor,
    ) -> None:
        self.graphs, self.inp, self.out, self.step = graphs, inp, out, step
        # (flat views made once: a call issues no op it need not, [Note: codec segments
        # replayed])
        self._inp_flat = inp.view(-1) if inp is not None else None
        self._out_flat = out.view(-1)
        # the encode draws this site's noise; the decode is the same for every site of a shape
        # (unless it writes the site's own state: the site then keys it by its noise too)
        self.encode_key, self.decode_key = (key, noise, "encode"), (key, "decode")
        self.hops: tuple[tuple[Hashable, Callable[[], None], Callable[[Any], None]], ...] = ()
        """A collective of several hops: ``(key, segment, exchange)`` of each segment between
        the encode and the decode, and the exchange after it (the two-level reduce-scatter's
        middle hop)."""

    def take(self, input: torch.Tensor) -> None:
        """The call's input into the captured buffers: copied into ``inp`` (a site whose
        encode reads other buffers, a policy split's parts, fills them here instead)."""
        self._inp_flat.copy_(input if input.dim() == 1 else input.reshape(-1))

    def encode(self) -> None:
        raise NotImplementedError

    def decode(self) -> None:
        raise NotImplementedError

    def exchange(self, stats: Any) -> None:
        raise NotImplementedError

    def run(
        self,
        output: torch.Tensor | None,
        input: torch.Tensor,
        step: int,
        stats: Any,
        name: str,
        *,
        count_call: bool = True,
    ):
        """One call: counted (unless ``count_call`` is False: a phase of a composite call);
        the input in (:meth:`take`) and the step written, the encode replayed, the exchange
        (on the current stream, after the encode), each of :attr:`hops` (its segment
        replayed, its exchange), the decode replayed, the output out (``input`` may alias
        ``output``: it is read first; None: left in the site's output). An empty output:
        nothing."""
        if count_call:
            stats.count_call(name)
        if self.out.numel() == 0:
            return
        self.take(input)
        self.step.fill_(step)
        self.graphs.run(self.encode_key, self.encode)
        self.exchange(stats)
        for key, segment, exchange in self.hops:
            self.graphs.run(key, segment)
            exchange(stats)
        self.graphs.run(self.decode_key, self.decode)
        if output is not None:
            (output if output.dim() == 1 else output.view(-1)).copy_(self._out_flat)
