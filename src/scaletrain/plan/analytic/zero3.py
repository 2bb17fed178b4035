"""The communication ZeRO-3 adds to a microbatch beyond its compute: per-unit all-gathers and reduce-scatters
with one unit of prefetch (Rajbhandari et al., arXiv 1910.02054 Sec. 7.2.2; FSDP, arXiv 2304.11277 Sec. 3.3).
Used by both the catalog model (`step_time.py`) and the model of our own runs (`plan/exact/run_time.py`).
"""

from __future__ import annotations

from scaletrain.plan.analytic.comm import MeasuredLink, gather_time, overlap_efficiency


def zero3_exposed_time(root_bytes: float, block_bytes: list[float], grad_ratio: float, block_f: float,
                       block_b: float, embed_f: float, head_f: float, head_b: float, embed_b: float, n: int,
                       link: tuple[float, float] | MeasuredLink, style: str = "prefetch",
                       block_r: float = 0.0, reshard: bool = True) -> float:
    """Communication time ZeRO-3 adds to one microbatch beyond its compute (Rajbhandari et al., arXiv
    1910.02054 Sec. 7.2.2; the schedule of our `parallel.zero` and of FSDP, arXiv 2304.11277 Sec. 3.3).

    Units: the root (embeddings, final norm, head: `root_bytes` of 16-bit parameters) and each block
    (`block_bytes`, forward order). Each unit's parameters are all-gathered before its forward and again
    before its backward, and its gradients (`grad_ratio` x its parameter bytes) are reduce-scattered after
    its backward. Prefetch is one unit ahead: the gather of unit i+1 is issued when unit i starts, so it
    hides behind at most unit i's compute; the root is gathered with nothing to hide behind, once before
    the forward and once before the backward. All collectives share one link and run in issue order
    (a FIFO channel, as one NCCL/gloo stream does); each costs alpha-beta time with the ring latency
    (n-1) alpha, so many small units are latency-bound. Returns the time the compute waits, found by
    running the two clocks (compute, channel) through the step's issue order, plus the part of the
    collective time the compute covered that it does not hide: 1 - the link's overlap efficiency of
    each kind (`MeasuredLink.overlap`; nothing for an alpha-beta link, which assumes perfect overlap).

    `style="per-tensor"` (DeepSpeed ZeRO-3 up to v0.4, `Assumptions.zero3_style`): the same forward; in
    the backward a block whose forward is recomputed (`block_r` of its `block_b` seconds) is gathered
    before the recomputation and again before its backward (the recomputed forward releases it), and the
    compute waits for each block's gradient reduce-scatter before it goes on.

    `reshard=False` (FSDP's reshard_after_forward=False): the units stay gathered from their forward to the end of
    their backward, so the backward gathers nothing (one all-gather per unit and microbatch).
    """
    if n <= 1:
        return 0.0
    measured = isinstance(link, MeasuredLink)
    launch_g = link.launch_time("all_gather") if measured else 0.0  # compute-thread cost of async issues
    launch_rs = link.launch_time("reduce_scatter") if measured else 0.0
    g = [gather_time(b, n, link) for b in block_bytes]
    rs = [gather_time(b * grad_ratio, n, link, "reduce_scatter") for b in block_bytes]
    g_root = gather_time(root_bytes, n, link)
    rs_root = gather_time(root_bytes * grad_ratio, n, link, "reduce_scatter")
    L = len(block_bytes)
    ch = 0.0  # when the channel is free
    ready = [0.0] * L
    unhidden = 0.0  # sum over collectives of duration x (1 - overlap efficiency of its kind)
    total = 0.0
    keep_g, keep_rs = 1.0 - overlap_efficiency(link, "all_gather"), 1.0 - overlap_efficiency(link, "reduce_scatter")

    def issue(at: float, dur: float, keep: float = keep_g) -> float:
        nonlocal ch, unhidden, total
        ch = max(ch, at) + dur
        unhidden += keep * dur
        total += dur
        return ch

    tc = issue(0.0, g_root)  # forward: the root, then block 0 prefetched behind the embedding
    if L:
        ready[0] = issue(tc, g[0])
        tc += launch_g
    tc += embed_f
    for i in range(L):
        tc = max(tc, ready[i])
        if i + 1 < L:
            ready[i + 1] = issue(tc, g[i + 1])
            tc += launch_g
        tc += block_f
    tc += head_f
    if reshard:  # backward: the root again (released after the forward), the last block prefetched
        tc = issue(tc, g_root)
        if L:
            ready[L - 1] = issue(tc, g[L - 1])
            tc += launch_g
    else:
        ready = [0.0] * L  # still gathered from the forward
    tc += head_b
    per_tensor = style == "per-tensor"
    for i in reversed(range(L)):
        tc = max(tc, ready[i])
        if per_tensor and block_r > 0:  # gathered again behind the recomputation
            again = issue(tc, g[i])
            tc = max(tc + block_r, again)
        if i > 0 and reshard:
            ready[i - 1] = issue(tc, g[i - 1])
            tc += launch_g
        tc += block_b - (block_r if per_tensor else 0.0)
        done = issue(tc, rs[i], keep_rs)
        tc = done if per_tensor else tc + launch_rs
    tc += embed_b
    tc = max(tc, issue(tc, rs_root, keep_rs))
    exposed = max(tc - (embed_f + L * block_f + head_f + head_b + L * block_b + embed_b), 0.0)
    # what the two clocks let the compute hide, it hides only by the overlap efficiency: the rest of the
    # covered collective time is paid by the compute (its share of that time, weighted by kind)
    covered = max(total - exposed, 0.0)
    return exposed + (unhidden / total if total else 0.0) * covered
