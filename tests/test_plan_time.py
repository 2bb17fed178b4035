"""The planner's step time: our own CPU runs after calibration (plan/exact/run_time.py) and the ZeRO-3
exposed-communication model (plan/analytic/zero3.py).

Step time against `scaletrain train`: the machine is shared with other developers' jobs (2 cores, load
average often 10+), so a single timing can be off by 2x. The test therefore (1) runs with one intra-op
thread, as each rank of a 2-process run has here (with two threads on shared cores, every OpenMP region
waits for whichever thread the OS has descheduled, and single steps vary up to 10x), and takes the
prediction's profile samples and the trainer's steps alternately, in the same process, so that both
see the same interference, (2) compares each step with the prediction composed from the sample taken
right after it and takes the median of these ratios (steps after the first), and (3) repeats this 3
times per configuration and asserts that the median of the 3 relative errors is within 25% (the issue's
target).

Two processes (`TWO_PROCESS`, every layout of two ranks): the same alternation on both ranks, each sample
followed by the in-place collective times (`run_comm`, as `plan --config --calibrate` takes them), the
tensor-parallel probe split over the run's real tp group; per pair the slower rank's composition against
the slower rank's step; the median of 10 repeats of 6 pairs within 25%, one procedure fixed in advance (a drift
of the machine's load during a set of 5 repeats moved its median by up to ~25%; 10 halve the weight of such a
drift, and a biased model moves every repeat alike). These need the two cores for
the two ranks: with a third busy process on the machine the in-place collective times overshoot (+30% to
+50% measured), so the test first checks that two spinning processes each get a core (skipped, with
the measured share, otherwise).

Run `python tests/test_plan_time.py` to print the tables of docs/planner-validation.md section 6.
"""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from scaletrain.plan.analytic.comm import MeasuredLink, gather_time
from scaletrain.plan.analytic.zero3 import zero3_exposed_time
from scaletrain.plan.exact.run_comm import overlap_efficiency

BASE = {"model.vocab_size": 256, "train.steps": 1000, "train.eval_every": 0, "train.checkpoint_every": 0}
SIZES = {  # three sizes and kinds (fp32 GELU; wider, longer; bf16 SwiGLU + RoPE with full recomputation)
    "2L d64 T64 fp32": {"model.n_layers": 2, "model.d_model": 64, "model.n_heads": 4, "model.seq_len": 64,
                        "train.global_batch": 8, "train.micro_batch": 4},
    "2L d128 T128 fp32": {"model.n_layers": 2, "model.d_model": 128, "model.n_heads": 4, "model.seq_len": 128,
                          "train.global_batch": 4, "train.micro_batch": 2},
    "2L d128 T64 bf16 swiglu rope full-recompute": {
        "model.n_layers": 2, "model.d_model": 128, "model.n_heads": 8, "model.seq_len": 64,
        "train.global_batch": 4, "train.micro_batch": 4, "train.dtype": "bf16", "memory.recompute": "full",
        "model.mlp": "swiglu", "model.position": "rope"},
}


def measure_and_predict(overrides: dict, repeats: int = 3, pairs: int = 6) -> list[dict]:
    """Per repeat: `pairs` trainer steps, each followed at once by one profile sample (so both see the
    same load); the median of the per-pair ratios predicted/measured, the median predicted step
    (`estimate_step_time`, what `plan --config --calibrate` reports) and the median measured step."""
    from harness import make_config

    from scaletrain.plan.exact.probe import RunProbe
    from scaletrain.train.trainer import Trainer

    cfg = make_config({**BASE, **overrides})
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # see the module docstring
    try:
        return _alternate(cfg, Trainer(cfg), RunProbe(cfg), repeats, pairs)
    finally:
        torch.set_num_threads(threads)


def _alternate(cfg, trainer, probe, repeats: int, pairs: int) -> list[dict]:
    from scaletrain.plan.exact.probe import profile_from_sample
    from scaletrain.plan.exact.run_time import estimate_step_time, predict_step_time

    trainer.train_step(1)  # the first step measures memory and warms up; the issue excludes it
    probe.sample()
    probe.sample()
    out = []
    for _ in range(repeats):
        steps, samples = [], []
        for _ in range(pairs):
            trainer.step += 1
            steps.append(trainer.train_step(trainer.step)["step_time_s"])
            samples.append(probe.sample())
        ratios = [predict_step_time(cfg, profile_from_sample(x)).step_time_s / m for x, m in zip(samples, steps)]
        out.append({"error": statistics.median(ratios) - 1, "predicted": estimate_step_time(cfg, samples).step_time_s,
                    "measured": statistics.median(steps)})
    return out


def assert_median_error_within(name: str, runs: list[dict], tolerance: float = 0.25) -> None:
    errors = [r["error"] for r in runs]
    assert abs(statistics.median(errors)) <= tolerance, (name, [f"{e:+.0%}" for e in errors], runs)


@pytest.mark.parametrize("name", list(SIZES))
def test_step_time_within_25_percent_of_measured_after_calibration(name):
    assert_median_error_within(name, measure_and_predict(SIZES[name]))


# --------------------------------------------------------------------------- two processes

TWO_PROCESS = {  # every parallel layout of two ranks, on the smallest size (its collectives matter most)
    "dp 2": {"parallel.dp": 2},
    "dp 2 ZeRO-1": {"parallel.dp": 2, "parallel.zero": 1},
    "dp 2 ZeRO-2": {"parallel.dp": 2, "parallel.zero": 2},
    "dp 2 ZeRO-3": {"parallel.dp": 2, "parallel.zero": 3},
    "tp 2": {"parallel.tp": 2},
    "pp 2 (1F1B)": {"parallel.pp": 2},
}


def _alternate_rank(rank, world, overrides, repeats, pairs):
    """On every rank: trainer steps alternating with profile samples and the in-place collective times
    (`run_comm.sample_with_comm`, what `plan --config --calibrate` takes), ranks aligned by a barrier
    before each step. Returns (step times, samples, alpha-beta link)."""
    import torch.distributed as dist
    from harness import make_config

    from scaletrain.distributed.process_group import DistEnv
    from scaletrain.plan.exact.probe import RunProbe
    from scaletrain.plan.exact.run_calibrate import measure_link
    from scaletrain.plan.exact.run_comm import sample_with_comm
    from scaletrain.train.trainer import Trainer

    cfg = make_config({**BASE, **SIZES["2L d64 T64 fp32"], **overrides})
    trainer = Trainer(cfg, None, DistEnv(rank, world, 0, "test"))
    probe = RunProbe(cfg, mesh=trainer.mesh)
    trainer.train_step(1)
    link = measure_link(cfg, [probe.sample() for _ in range(3)])
    steps, samples = [], []
    for _ in range(repeats * pairs):
        dist.barrier()
        trainer.step += 1
        steps.append(trainer.train_step(trainer.step)["step_time_s"])
        samples.append(sample_with_comm(cfg, probe, trainer.mesh))
    return steps, samples, link


def measure_and_predict_two_processes(overrides: dict, repeats: int = 5, pairs: int = 6) -> list[dict]:
    """As `measure_and_predict`, on two processes: per pair, the slower rank's composed step against the
    slower rank's measured step; per repeat, the median of the ratios."""
    from harness import make_config, run_ranks

    from scaletrain.plan.exact.probe import profile_from_sample
    from scaletrain.plan.exact.run_time import predict_step_time

    cfg = make_config({**BASE, **SIZES["2L d64 T64 fp32"], **overrides})
    ranks = run_ranks(_alternate_rank, 2, overrides, repeats, pairs, timeout=300)
    link = ranks[0][2]
    out = []
    for r in range(repeats):
        pred, meas = [], []
        for i in range(r * pairs, (r + 1) * pairs):
            pred.append(max(predict_step_time(cfg, profile_from_sample(steps_samples[1][i], link)).step_time_s
                            for steps_samples in ranks))
            meas.append(max(steps_samples[0][i] for steps_samples in ranks))
        out.append({"error": statistics.median(p / m for p, m in zip(pred, meas)) - 1,
                    "predicted": statistics.median(pred), "measured": statistics.median(meas)})
    return out


def _spin(seconds: float) -> float:
    """CPU share one process gets while spinning for `seconds` of wall time."""
    import time

    w0, c0 = time.perf_counter(), time.process_time()
    while time.perf_counter() - w0 < seconds:
        pass
    return (time.process_time() - c0) / (time.perf_counter() - w0)


def two_cores_free() -> float:
    """The smaller CPU share of two processes spinning together: ~1.0 when the machine has two cores for
    the run's two ranks, ~0.67 when a third busy process competes."""
    import multiprocessing as mp

    with mp.get_context("spawn").Pool(2) as pool:
        return min(pool.map(_spin, [0.5, 0.5]))


@pytest.mark.parametrize("name", list(TWO_PROCESS))
def test_two_process_step_time_within_25_percent_of_measured(name):
    share = two_cores_free()
    if share < 0.85:  # a timing claim about two ranks on two cores needs the two cores
        pytest.skip(f"another job holds the CPU (each of two spinning processes got {share:.0%} of a core)")
    runs = measure_and_predict_two_processes(TWO_PROCESS[name], repeats=10)  # one procedure, no second try
    assert_median_error_within(name, runs)


# --------------------------------------------------------------------------- ZeRO-3 exposed communication

LINK = (1e9, 1e-5)  # 1 GB/s, 10 us per ring step


def test_zero3_nothing_exposed_with_an_infinitely_fast_link():
    t = zero3_exposed_time(1e6, [1e6] * 4, 2.0, 1.0, 1.0, 0.1, 0.1, 0.1, 0.1, 8, (math.inf, 0.0))
    assert t == 0.0
    assert zero3_exposed_time(1e6, [1e6] * 4, 2.0, 1.0, 1.0, 0, 0, 0, 0, 1, LINK) == 0.0  # dp = 1


def test_zero3_compute_bound_exposes_only_the_unhidden_ends():
    # every block's gather (and, in backward, gather + reduce-scatter) is shorter than its compute: only
    # what has nothing before it to hide behind is exposed -- the root's gather before the forward and
    # before the backward, the first block's gather of each pass, and the last two reduce-scatters
    n, blk, root = 4, 4e6, 8e6
    g, g_root = gather_time(blk, n, LINK), gather_time(root, n, LINK)
    rs, rs_root = gather_time(2 * blk, n, LINK), gather_time(2 * root, n, LINK)
    c_f, c_b = 10 * (g + rs), 20 * (g + rs)
    t = zero3_exposed_time(root, [blk] * 6, 2.0, c_f, c_b, 0.0, 0.0, 0.0, 0.0, n, LINK)
    assert t == pytest.approx(2 * g_root + 2 * g + rs + rs_root, rel=1e-12)


def test_zero3_communication_bound_forward_runs_at_the_gather_rate():
    # gathers slower than compute: each prefetch hides one block's compute, so the forward takes
    # g_root + L g + c_f and the backward is bounded by its channel (g + rs per block)
    n, blk, L = 4, 4e6, 6
    g, rs = gather_time(blk, n, LINK), gather_time(blk, n, LINK)
    c_f, c_b = g / 4, g / 4
    t = zero3_exposed_time(0.0, [blk] * L, 1.0, c_f, c_b, 0.0, 0.0, 0.0, 0.0, n, LINK)
    g0 = gather_time(0.0, n, LINK)  # latency only
    forward = g0 + L * g + c_f
    backward = g0 + L * g + (L - 1) * rs + max(c_b, rs) + g0  # the channel: gathers, then every reduce-scatter
    assert t == pytest.approx(forward + backward - L * (c_f + c_b), rel=1e-9)


def test_zero3_exposure_grows_as_the_link_slows():
    args = (1e7, [2e7] * 8, 1.0, 0.01, 0.02, 0.001, 0.002, 0.004, 0.002, 16)
    times = [zero3_exposed_time(*args, (bw, 1e-5)) for bw in (1e12, 1e10, 1e9, 1e8)]
    assert times == sorted(times) and times[0] < 1e-3 < times[-1]


# --------------------------------------------------------------------------- overlap efficiency


def test_overlap_efficiency_from_the_three_timings():
    assert overlap_efficiency(2.0, 1.0, 2.0) == 1.0  # the collective hides entirely behind the compute
    assert overlap_efficiency(2.0, 1.0, 3.0) == 0.0  # no faster than one after the other
    assert overlap_efficiency(2.0, 1.0, 2.5) == pytest.approx(0.5)
    assert overlap_efficiency(1.0, 3.0, 3.5) == pytest.approx(0.5)  # here the compute is the shorter
    assert overlap_efficiency(2.0, 1.0, 1.5) == 1.0 and overlap_efficiency(2.0, 1.0, 4.0) == 0.0  # clamped


def _flat_link(times: dict[str, float], overlap: dict[str, float]) -> MeasuredLink:
    """A measured link whose collectives of each kind take the same time at every size."""
    table = tuple((k, ((1, t), (1 << 40, t))) for k, t in sorted(times.items()))
    return MeasuredLink(1e9, 1e-5, table, (), tuple(sorted(overlap.items())))


def test_zero3_pays_what_the_overlap_efficiency_does_not_hide():
    # compute-bound: with perfect overlap only the unhidden ends are exposed (as above); with none, every
    # collective is paid; in between, the covered time in proportion to each kind's share of 1 - efficiency
    L, g, rs = 4, 1e-3, 2e-3
    args = (1e6, [1e6] * L, 2.0, 1.0, 2.0, 0.0, 0.0, 0.0, 0.0, 2)

    def exposed(eff_g: float, eff_rs: float) -> float:
        return zero3_exposed_time(*args, _flat_link({"all_gather": g, "reduce_scatter": rs},
                                                    {"all_gather": eff_g, "reduce_scatter": eff_rs}))

    perfect = 2 * g + 2 * g + rs + rs  # the root's two gathers, block 0's and block L-1's, the last two rs
    total = (2 + 2 * L) * g + (L + 1) * rs
    assert exposed(1.0, 1.0) == pytest.approx(perfect, rel=1e-12)
    assert exposed(0.0, 0.0) == pytest.approx(total, rel=1e-12)
    assert exposed(0.5, 0.5) == pytest.approx(perfect + 0.5 * (total - perfect), rel=1e-12)
    share_rs = (L + 1) * rs / total  # gathers hidden perfectly, reduce-scatters not at all
    assert exposed(1.0, 0.0) == pytest.approx(perfect + share_rs * (total - perfect), rel=1e-12)


def _profile(comm: dict):
    from scaletrain.plan.exact.probe import RunProfile

    return RunProfile(block_f=2e-3, block_b=4e-3, embed_f=1e-3, embed_b=1e-3, head_f=2e-3, head_b=2e-3,
                      optimizer=1e-3, loader=1e-4, link_bw=1e9, link_latency=1e-5, comm=comm)


def test_data_parallel_buckets_hide_by_the_overlap_efficiency():
    # several buckets: all but the last are reduced during the backward, which hides them by the efficiency
    from harness import make_config

    from scaletrain.plan.exact.run_time import predict_step_time

    cfg = make_config({**BASE, **SIZES["2L d64 T64 fp32"], "parallel.dp": 2, "parallel.bucket_mb": 0.05})
    t = 1e-3  # every all-reduce, much shorter than the last backward
    dp = {}
    for eff in (1.0, 0.25, 0.0):
        comm = {"dp": {"all_reduce": [(1, t), (1 << 40, t)], "overlap": {"all_reduce": eff}}}
        dp[eff] = predict_step_time(cfg, _profile(comm)).breakdown["dp_comm"]
    assert dp[1.0] == pytest.approx(t, rel=1e-12)  # the last bucket only
    assert dp[0.0] == pytest.approx(2 * t, rel=1e-12)  # and the earlier ones, not hidden at all
    assert dp[0.25] == pytest.approx(t + 0.75 * t, rel=1e-12)


def test_pipeline_sends_cost_the_sender_what_the_overlap_efficiency_does_not_hide():
    # each stage's forward that sends (all but the last) and backward that sends (all but the first) pays
    # (1 - efficiency) x the message time; the schedule is simulated with those times
    from harness import make_config

    from scaletrain.parallel.pipeline.schedules import build_schedule
    from scaletrain.parallel.pipeline.simulate import simulate
    from scaletrain.plan.exact.run_time import predict_step_time

    cfg = make_config({**BASE, **SIZES["2L d64 T64 fp32"], "parallel.pp": 2})
    p2p, eff = 1.5e-3, 0.2
    prof = _profile({"pp": {"p2p": [(1, p2p), (1 << 40, p2p)], "overlap": {"p2p": eff}}})
    send = (1 - eff) * p2p
    tf = [[prof.block_f + prof.embed_f + send], [prof.block_f + prof.head_f]]
    tb = [[prof.block_b + prof.embed_b], [prof.block_b + prof.head_b + send]]
    sim = simulate(build_schedule("1f1b", 2, cfg.grad_accum, 1), tf, tb, 0.0, t_comm=p2p)
    step = predict_step_time(cfg, prof)
    assert step.breakdown["compute"] + step.breakdown["bubble"] == pytest.approx(sim.makespan, rel=1e-12)
    perfect = _profile({"pp": {"p2p": [(1, p2p), (1 << 40, p2p)], "overlap": {"p2p": 1.0}}})
    assert predict_step_time(cfg, perfect).step_time_s < step.step_time_s


def _row(name: str, runs: list[dict]) -> str:
    mid = sorted(runs, key=lambda r: r["error"])[len(runs) // 2]
    ratio = mid["predicted"] / mid["measured"] - 1
    return (f"| {name} | {mid['predicted']:.4f} | {mid['measured']:.4f} | {ratio:+.0%}"
            f" | {', '.join(format(r['error'], '+.0%') for r in runs)} |")


if __name__ == "__main__":  # the tables of docs/planner-validation.md section 6
    head = "| {} | predicted s | measured s | ratio of medians | paired errors (repeats) |\n|---|---|---|---|---|"
    print(head.format("config"))
    for name, ov in SIZES.items():
        print(_row(name, measure_and_predict(ov)))
    print()
    print(head.format("layout (2 processes)"))
    for name, ov in TWO_PROCESS.items():
        print(_row(name, measure_and_predict_two_processes(ov)))


@pytest.mark.parametrize("name", ["adafactor", "sm3"])
def test_probe_times_the_engines_factored_optimizer_under_zero(name):
    """Under ZeRO the engine steps Adafactor / SM3 as `zero_factored.ShardedFactored` over the shard's pieces; the
    probe timed AdamW there with the configured optimizer's keywords and failed to build (ConfigError)."""
    from harness import TINY, make_config

    from scaletrain.parallel.zero_factored import ShardedFactored
    from scaletrain.plan.exact.probe import RunProbe

    cfg = make_config({**TINY, "parallel.dp": 2, "parallel.zero": 1, "optim.name": name})
    probe = RunProbe(cfg)
    assert isinstance(probe.opt, ShardedFactored) and probe.opt.name == name
    assert sum(b - a for _, a, b in probe._optimizer_pieces()) == sum(p.numel() for p in probe.opt_params)
    assert probe.sample()["optimizer"] > 0
