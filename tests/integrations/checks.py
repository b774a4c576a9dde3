"""What every framework adapter's tests check alike."""

from __future__ import annotations


def assert_bytes_counted_and_fewer(plain: dict, qsdp: dict, kind: str, steps: int) -> None:
    """``qsdp``'s run (its ``qsdp_bytes`` counted by qsdp, ``dist_bytes`` all that crossed
    ``torch.distributed``) sent fewer bytes than ``plain``'s uncompressed one, and qsdp's
    counter is all that crossed but the training loop's own few scalars."""
    assert plain["qsdp_bytes"] is None
    if kind == "fsdp2":  # FSDP2's own gathers and reduce-scatters, counted as they crossed
        uncompressed = plain["dist_bytes"]
        assert uncompressed > 4 * plain["numel"] * steps // 2  # at least the reduce-scatters
        ratio = 0.5  # 8-bit weights and gradients, their scales and the raw 1-D parameters
    else:  # DDP's fp32 all-reduce of every gradient, every step (not a torch.distributed call)
        uncompressed = 4 * plain["numel"] * steps
        ratio = 0.3  # CGX's 4-bit codes, scales, the raw 1-D parameters
    assert 0 < qsdp["qsdp_bytes"] < ratio * uncompressed, (qsdp["qsdp_bytes"], uncompressed)
    # (the loss, the gradient norm: the loop's own scalars)
    assert qsdp["qsdp_bytes"] <= qsdp["dist_bytes"] < qsdp["qsdp_bytes"] + 1024, qsdp
