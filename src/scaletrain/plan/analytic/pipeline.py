"""The pipeline schedules in closed form: the microbatch-chunks a rank holds at once (activation memory) and
the time of one step's pipeline (its bubble).

GPipe (arXiv 1811.06965), 1F1B / PipeDream-flush and 2BW (arXiv 2006.09503), Megatron's interleaved schedule
(arXiv 2104.04473 Sec. 2.2.2; its memory: Korthikanti et al. arXiv 2205.05198 Sec. 4.2.3) and ZB-H1 (arXiv
2401.10241). The closed forms equal the makespan and peak in-flight count of `scaletrain.parallel.pipeline.
simulate` (tests/test_plan_search.py); the search uses them because it evaluates thousands of layouts.
"""

from __future__ import annotations


def inflight_chunks(schedule: str, p: int, m: int, v: int) -> int:
    """Peak microbatch-chunks whose activations rank 0 holds (the most loaded rank).

    GPipe: all m; 1F1B, ZB-H1 and 2BW: min(p, m) (PipeDream-flush, arXiv 2006.09503; ZB-H1 keeps 1F1B's
    memory, arXiv 2401.10241); interleaved: Megatron's warm-up (p-1)*2 + (v-1)*p plus the one in steady
    state, i.e. L(1 + (p-1)/(pv)) layers' worth (Korthikanti Sec. 4.2.3).
    """
    if schedule == "gpipe":
        return m * v
    if schedule == "interleaved" and v > 1:
        return min(m * v, 2 * (p - 1) + (v - 1) * p + 1)
    return min(p, m)


def pipeline_time(schedule: str, p: int, m: int, v: int, t_f: float, t_b: float, t_w: float = 0.0) -> float:
    """Time of one step's pipeline for per-microbatch stage times t_f (forward), t_b (backward for
    inputs, or the whole backward when t_w = 0) and t_w (backward for weights); closed forms:

    GPipe / 1F1B: (m + p - 1)(t_f + t_b + t_w) (GPipe arXiv 1811.06965, bubble (p-1)/(m+p-1));
    interleaved with v chunks: (m + (p-1)/v)(t_f + t_b + t_w) (arXiv 2104.04473 Sec. 2.2.2);
    ZB-H1: m(t_f + t_b + t_w) + (p-1) max(t_f + t_b - t_w, t_f) (arXiv 2401.10241 Sec. 3);
    2BW: no flush between steps, so in steady state m(t_f + t_b + t_w) per step (arXiv 2006.09503);
    the simulator, which runs one isolated step, adds the fill and drain (p-1)(t_f + t_b + t_w) once.
    These agree with `scaletrain.parallel.pipeline.simulate` for uniform stage times
    (tests/test_plan_search.py); the planner uses the closed forms because they cost nothing.
    """
    work = t_f + t_b + t_w
    if p == 1 or schedule == "2bw":
        return m * work
    if schedule == "interleaved":
        return (m + (p - 1) / v) * work
    if schedule == "zb-h1":  # the W passes cannot fill more than the forward warm-up leaves
        return m * work + (p - 1) * max(t_f + t_b - t_w, t_f)
    return (m + p - 1) * work
