"""Context parallelism (parallel/context/, docs/context_parallel.md): ring attention with causal load balancing
(arXiv 2310.01889) and DeepSpeed-Ulysses (arXiv 2309.14509).

- The ring's blocks cover the causal square exactly once for every rank and cp; the block kernels (torch's fused
  CPU flash kernel and the explicit one) combine by online softmax into SDPA's output and gradients.
- Ring and Ulysses attention at cp = 4 equal torch's SDPA on the whole sequence (outputs and q, k, v gradients), with
  as many key/value heads as query heads and with fewer (grouped-query).
- Through the trainer, fp64, every step's loss and every final parameter equal the single-process run (rtol 1e-9,
  atol 1e-12: the measured differences are <= 1e-14, rounding; the faults below move them by 1e-3 or more):
  ring with grouped-query attention, RoPE, dropout and attn-core (selective) recomputation (cp 2); cp 2 x tp 2
  with sequence parallelism (Ulysses, dropout, RoPE); and checkpoints resharded cp 2 -> 1 and 1 -> 2. The other
  layouts (Ulysses with ZeRO-3, cp x dp x ep with ZeRO-1, cp x pp interleaved) are `scaletrain verify` commands in
  docs/context_parallel.md and layouts of the layout matrix (configs/covering.json).
- In the same runs the bytes each rank sends for cp per step equal the planner's (`plan.analytic.context.step_bytes`),
  and the measured memory per category equals `predict_run`'s to the byte.
- The comparison fails for a dropped key/value chunk and for a missing causal mask on the diagonal block.
- validate() refuses what context parallelism does not split or compose with, in one line (exit 2 on the command
  line); the planner takes cp in --layout, picks it for long sequences and divides activations by it.
"""

from __future__ import annotations

import math
from contextlib import contextmanager

import pytest
import torch
import torch.nn.functional as F
from harness import TINY, assert_same_run, make_config, measured_and_planned, run_ranks, train_reference

from scaletrain.cli import main
from scaletrain.config import load_config, validate
from scaletrain.errors import ConfigError
from scaletrain.parallel.context.kernels import block_backward, block_forward, default_scale, merge_
from scaletrain.parallel.context.layout import chunks_of, local_positions
from scaletrain.parallel.context.ring import _block
from scaletrain.verify.layouts import Layout

RTOL, ATOL = 1e-9, 1e-12
MOE = {"model.moe.experts": 4, "model.moe.group_tokens": 8}
CASES = {  # name -> (world, overrides): the two layouts CI trains (the others: docs/context_parallel.md, "Verify")
    "ring gqa rope dropout selective": (2, {"parallel.cp": 2, "model.position": "rope", "model.dropout": 0.1,
                                            "memory.recompute": "selective", "model.n_kv_heads": 2}),
    "cp2 tp2 sp ulysses dropout rope": (4, {"parallel.cp": 2, "parallel.tp": 2, "parallel.sequence_parallel": True,
                                            "parallel.cp_mode": "ulysses", "model.dropout": 0.1,
                                            "model.position": "rope"}),
}
FAULTS = ("drop a kv chunk", "no causal mask on the diagonal block")
# low-precision cp x MoE layouts of the layout matrix, run by its own runner and compared step by step under
# teacher-forced routing (verify/stepwise.py): token choice on the ring's two chunks, expert choice under Ulysses
MOE_LAYOUTS = (Layout.of(cp=2, moe="topk", dtype="fp32", position="rope"),
               Layout.of(cp=2, cp_mode="ulysses", moe="expert_choice", dtype="bf16", dropout=0.1))


# --------------------------------------------------------------------------- the ring's geometry and kernels


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_ring_blocks_cover_the_causal_square_exactly_once(cp):
    T = 4 * cp * 2
    seen = torch.zeros(T, T, dtype=torch.int64)
    for r in range(cp):
        mine = local_positions(T, cp, r, "ring")
        assert sorted(p for a, b in chunks_of(T, cp, r, "ring") for p in range(a, b)) == mine.tolist()
        for i in range(cp):
            src = (r - i) % cp
            qs, ks, causal = _block(r, src, len(mine) // 2)
            q, k = mine[qs], local_positions(T, cp, src, "ring")[ks]
            allowed = k.view(1, -1) <= q.view(-1, 1)
            if causal:
                allowed &= torch.ones_like(allowed).tril().bool()
            else:  # an off-diagonal block is wholly below the diagonal: nothing masked
                assert allowed.all()
            seen[q.view(-1, 1), k.view(1, -1)] += allowed.long()
    assert torch.equal(seen, torch.ones(T, T, dtype=torch.int64).tril())
    work = {int((local_positions(T, cp, r, "ring") + 1).sum()) for r in range(cp)}  # (query, key) pairs per rank
    assert len(work) == 1  # load balancing: every rank attends the same number of pairs


@pytest.mark.parametrize("fused", [True, False])
def test_blocks_combined_by_online_softmax_equal_sdpa(monkeypatch, fused):
    """Two chunks of queries and keys as three blocks (two diagonal, one below), grouped-query heads: torch's fused CPU
    flash kernel, or the explicit kernel that every other device and dropout run."""
    import scaletrain.parallel.context.kernels as K

    if not fused:
        monkeypatch.setattr(K, "_fused", lambda q, drop: False)
    torch.manual_seed(0)
    B, h, hkv, T, d = 2, 4, 2, 16, 8
    q, k, v, do = (torch.randn(B, n, T, d, dtype=torch.float64) for n in (h, hkv, hkv, h))
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    ref = F.scaled_dot_product_attention(qr, kr.repeat_interleave(2, 1), vr.repeat_interleave(2, 1), is_causal=True)
    ref.backward(do)
    c, s = T // 2, default_scale(d)
    blocks = ((slice(None, c), slice(None, c), True), (slice(c, None), slice(None, c), False),
              (slice(c, None), slice(c, None), True))
    out = torch.zeros(B, h, T, d, dtype=torch.float64)
    lse = torch.full((B, h, T), -math.inf, dtype=torch.float64)
    for qs, ks, causal in blocks:
        o, ls = block_forward(q[:, :, qs], k[:, :, ks], v[:, :, ks], causal, s)
        merge_(out[:, :, qs], lse[:, :, qs], o, ls)
    torch.testing.assert_close(out, ref.detach(), rtol=1e-12, atol=1e-12)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for qs, ks, causal in blocks:
        gq, gk, gv = block_backward(do[:, :, qs], q[:, :, qs], k[:, :, ks], v[:, :, ks], out[:, :, qs],
                                    lse[:, :, qs], causal, s)
        dq[:, :, qs] += gq
        dk[:, :, ks] += gk
        dv[:, :, ks] += gv
    for got, want in ((dq, qr.grad), (dk, kr.grad), (dv, vr.grad)):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def _attention_rank(rank, world, cases):
    import torch.distributed as dist

    from scaletrain.parallel.context.comm import Ring
    from scaletrain.parallel.context.ring import RingAttention
    from scaletrain.parallel.context.ulysses import UlyssesCore

    def sdpa(q, k, v):
        rep = q.shape[1] // k.shape[1]
        return F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1),
                                              is_causal=True)

    out = []
    for mode, hkv in cases:
        torch.manual_seed(1)
        B, h, T, d = 1, 4, 16, 4
        q, k, v = (torch.randn(B, n, T, d, dtype=torch.float64) for n in (h, hkv, hkv))
        do = torch.randn(B, h, T, d, dtype=torch.float64)
        qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
        sdpa(qr, kr, vr).backward(do)
        every = [local_positions(T, world, j, mode) for j in range(world)]
        mine = every[rank]
        ql, kl, vl = (t[:, :, mine].clone().requires_grad_() for t in (q, k, v))
        if mode == "ring":
            y = RingAttention.apply(ql, kl, vl, Ring(dist.group.WORLD, list(range(world)), rank), default_scale(d),
                                    None, every)
        else:
            y = UlyssesCore(sdpa, dist.group.WORLD, None)(ql, kl, vl)
        y.backward(do[:, :, mine])
        ref_y = F.scaled_dot_product_attention(q, k.repeat_interleave(h // hkv, 1), v.repeat_interleave(h // hkv, 1),
                                               is_causal=True)
        out.append(max(float((a - b).abs().max()) for a, b in ((y, ref_y[:, :, mine]), (ql.grad, qr.grad[:, :, mine]),
                                                               (kl.grad, kr.grad[:, :, mine]),
                                                               (vl.grad, vr.grad[:, :, mine]))))
    return out


ATTENTION_CASES = [("ring", 4), ("ring", 2), ("ulysses", 4)]


def test_ring_and_ulysses_attention_at_cp4_equal_sdpa_with_and_without_grouped_kv_heads(runs):
    for r, errs in enumerate(runs["attention at cp4"]):  # run by the world-4 processes of `runs`
        for (mode, hkv), err in zip(ATTENTION_CASES, errs):
            assert err < 1e-12, f"rank {r} {mode} kv heads {hkv}: {err}"


# --------------------------------------------------------------------------- through the trainer


@contextmanager
def _fault(name: str | None):
    """A plausible bug of the ring, injected in this rank's process for the duration of a run."""
    from scaletrain.parallel.context import comm as C
    from scaletrain.parallel.context import ring as R

    if name is None:
        yield
        return
    exchange, block = C.Ring.exchange, R._block
    if name == "drop a kv chunk":  # the key/value messages arrive as zeros (a lost or unwaited buffer)
        def dropping(self, send, tag):
            ex = exchange(self, send, tag)
            if tag == C.TAG_KV:
                wait = ex.wait
                ex.wait = lambda: torch.zeros_like(wait())
            return ex
        C.Ring.exchange = dropping
    elif name == "no causal mask on the diagonal block":
        R._block = lambda r, src, c: (slice(None), slice(None), False) if src == r else block(r, src, c)
    else:
        raise ValueError(name)
    try:
        yield
    finally:
        C.Ring.exchange, R._block = exchange, block


def _train_rank(rank, world, jobs):
    """Each job: (overrides, fault, out dir or None, steps to run, reshard) -> losses, state (rank 0), memory
    measured and planned, the step's cp bytes; or ("attention", cases) -> `_attention_rank`'s errors."""
    from scaletrain.distributed.process_group import DistEnv
    from scaletrain.train.trainer import Trainer

    out = []
    for job in jobs:
        if job[0] == "attention":
            out.append(_attention_rank(rank, world, job[1]))
            continue
        if job[0] == "layout":  # the layout matrix's own runner (teacher-forced routing in low precision)
            from scaletrain.verify.matrix import run_layout

            out.append(run_layout(job[1], DistEnv(rank, world, 0, "test"), root=job[2]))
            continue
        overrides, fault, directory, stop, reshard = job
        cfg = make_config({**TINY, **overrides})
        with _fault(fault):
            t = Trainer(cfg, directory, DistEnv(rank, world, 0, "test"), reshard=reshard)
            result = t.run(stop_after=stop)
            state = t.full_state()
        comm = {k: v for k, v in result.last_row.items() if k.startswith("comm_cp")}
        out.append((result.losses, state if rank == 0 else None, measured_and_planned(t) if t.mem else {}, comm))
    return out


@pytest.fixture(scope="module")
def references():
    return {name: train_reference({k: v for k, v in o.items() if not k.startswith("parallel.")})
            for name, (_, o) in CASES.items()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every parallel run of this module, one set of processes per world size. The world-2 set also trains the
    checkpoint halves: 2 steps at cp 2 (then resumed at cp 1 in the test), and 2 steps at cp 2 (Ulysses) resumed
    from a single-process checkpoint written here first."""
    from scaletrain.train.trainer import Trainer

    base = CASES["ring gqa rope dropout selective"][1]
    down, up = tmp_path_factory.mktemp("cp2to1"), tmp_path_factory.mktemp("cp1to2")
    ckpt = {"train.checkpoint_every": 2}
    Trainer(make_config({**TINY, **base, **ckpt, "parallel.cp": 1}), up).run(stop_after=2)
    jobs = {2: [], 4: []}
    for name, (world, o) in CASES.items():
        jobs[world].append((name, (o, None, None, None, False)))
    for fault in FAULTS:
        jobs[2].append((fault, (base, fault, None, None, False)))
    jobs[2].append(("cp2 -> 1 first half", ({**base, **ckpt}, None, str(down), 2, False)))
    jobs[2].append(("cp1 -> 2 second half", ({**base, **ckpt, "parallel.cp_mode": "ulysses"}, None, str(up), None,
                                             True)))
    jobs[4].append(("attention at cp4", ("attention", ATTENTION_CASES)))
    for lay in MOE_LAYOUTS:
        jobs[lay.world].append((lay.name, ("layout", lay, str(tmp_path_factory.mktemp("tape")))))
    done = {}
    for world, todo in jobs.items():
        results = run_ranks(_train_rank, world, [j for _, j in todo], timeout=900)
        for i, (name, _) in enumerate(todo):
            done[name] = [r[i] for r in results]
    done["cp2 -> 1 dir"], done["cp1 -> 2 dir"] = down, up
    for lay in MOE_LAYOUTS:
        done[lay.name + " dir"] = jobs[lay.world][[n for n, _ in jobs[lay.world]].index(lay.name)][1][2]
    return done


@pytest.mark.parametrize("name", list(CASES))
def test_layout_with_cp_matches_single_process(references, runs, name):
    losses, state, _, _ = runs[name][0]
    assert_same_run(references[name], (losses, state), RTOL, ATOL)


@pytest.mark.parametrize("name", list(CASES))
def test_cp_bytes_per_step_equal_the_planners(runs, name):
    from scaletrain.plan.analytic.context import step_bytes

    world, o = CASES[name]
    want = step_bytes(make_config({**TINY, **o})).as_metrics()
    for rank, (_, _, _, comm) in enumerate(runs[name]):
        assert comm == want and want, f"rank {rank}: {comm} vs planned {want}"


@pytest.mark.parametrize("name", list(CASES))
def test_cp_run_memory_equals_the_prediction_to_the_byte(runs, name):
    mem = runs[name][0][2]
    for key, (measured, planned) in mem.items():
        if planned is None:  # router noise / expert dropout: activations not predicted (run_memory.py)
            assert key == "activations" and "moe" in name
            continue
        assert measured == planned, f"{key}: measured {measured} vs planned {planned}"


@pytest.mark.parametrize("fault", FAULTS)
def test_comparison_fails_for_a_broken_ring(references, runs, fault):
    losses, state, _, _ = runs[fault][0]
    with pytest.raises(AssertionError):
        assert_same_run(references["ring gqa rope dropout selective"], (losses, state), RTOL, ATOL)


def test_checkpoints_reshard_from_cp2_to_one_process_and_from_one_process_to_cp2(references, runs):
    from scaletrain.train.trainer import Trainer

    ref = references["ring gqa rope dropout selective"]
    base = {**CASES["ring gqa rope dropout selective"][1], "train.checkpoint_every": 2, "parallel.cp": 1}
    first = runs["cp2 -> 1 first half"][0][0]
    t = Trainer(make_config({**TINY, **base}), runs["cp2 -> 1 dir"], reshard=True)
    second = t.run().losses
    assert t.step == TINY["train.steps"] and min(second) == 3
    assert_same_run(ref, ({**first, **second}, t.full_state()), RTOL, ATOL)
    losses, state, _, _ = runs["cp1 -> 2 second half"][0]
    assert min(losses) == 3
    assert_same_run(({k: v for k, v in ref[0].items() if k > 2}, ref[1]), (losses, state), RTOL, ATOL)


def test_run_report_of_a_cp_run_compares_each_ranks_memory_with_its_stage_plan(runs):
    """The run page places a cp rank on its pipeline stage (grid pp x dp x cp x tp) for the planned memory."""
    from scaletrain.report.run_page import write_report

    write_report(runs["cp1 -> 2 dir"])
    page = (runs["cp1 -> 2 dir"] / "report.html").read_text()
    assert "rank 1" in page and "planned" in page


# --------------------------------------------------------------------------- teacher-forced MoE routing


@pytest.mark.parametrize("mode,cp,tp", [("ring", 2, 1), ("ring", 4, 1), ("ulysses", 2, 1), ("ring", 2, 2)])
def test_routing_tape_keys_every_token_of_every_cp_rank_by_its_global_position(mode, cp, tp):
    """The tape's token ids of all cp (x sequence-parallel tp) ranks together are each token of the step's batch
    exactly once, at (global row) x seq_len + global position: what one process records for the same tokens."""
    from scaletrain.config import MoEConfig
    from scaletrain.model.moe import MoE
    from scaletrain.model.routing_tape import RoutingTape

    T, rows, first = 32, 3, 5
    seen = []
    for r in range(cp):
        mine = local_positions(T, cp, r, mode)
        for shard in mine.chunk(tp):
            moe = MoE(8, 16, "gelu", MoEConfig(experts=4, group_tokens=4))
            moe.key, moe.token_positions = (0, 1, first), (shard, T)
            ids = RoutingTape._token_ids(moe, rows, rows * len(shard)).view(rows, -1)
            assert torch.equal(ids, (torch.arange(first, first + rows).view(rows, 1) * T + shard.view(1, -1)))
            seen.append(ids.reshape(-1))
    single = MoE(8, 16, "gelu", MoEConfig(experts=4, group_tokens=4))
    single.key = (0, 1, first)
    assert torch.equal(torch.cat(seen).sort().values, RoutingTape._token_ids(single, rows, rows * T))


@pytest.mark.parametrize("lay", MOE_LAYOUTS, ids=[lay.name.replace(" ", ",") for lay in MOE_LAYOUTS])
def test_cp_moe_layout_matches_one_process_under_teacher_forced_routing(runs, lay):
    """The matrix's check of a low-precision cp x MoE layout: one process replays the layout's routes, every token
    found (a token keyed by its rank-local position is a missing decision, a FAIL), and the step-by-step differences
    within the dtype's bounds; the one process's own router agrees on all but a few (ROUTING_DISAGREEMENT)."""
    from scaletrain.verify.matrix import check, table

    outcome = check(lay, runs[lay.name][0], runs[lay.name + " dir"])
    assert outcome.ok and not outcome.error, "\n" + table([outcome], width=200)
    assert math.isfinite(outcome.routing)  # the tape replayed decisions (its disagreement bound is in `check`)
    print(table([outcome], width=160))


# --------------------------------------------------------------------------- bad input, planner


@pytest.mark.parametrize("overrides, fragment", [
    ({"parallel.cp": 3}, "splits each sequence into 2 x parallel.cp = 6 chunks: model.seq_len (32) is not divisible"),
    ({"parallel.cp": 2, "parallel.cp_mode": "ulysses", "model.n_heads": 2, "model.d_model": 32, "parallel.tp": 2},
     "model.n_heads (2) / parallel.tp (2) = 1 is not divisible by 2"),
    ({"parallel.cp": 2, "parallel.cp_mode": "stripes"}, "parallel.cp_mode must be ring or ulysses, got 'stripes'"),
    ({"parallel.cp": 2, "parallel.tp": 4, "parallel.tp_mode": "2d"}, "parallel.tp_mode=2d with parallel.cp (2) > 1"),
    ({"parallel.cp": 2, "model.dropout": 0.1, "model.dropout_impl": "torch"}, "model.dropout_impl=torch with"),
    ({"parallel.cp": 2, "parallel.pp": 2, "parallel.partition": "time"}, "parallel.partition=time with"),
    ({"parallel.cp": 2, "parallel.pp": 2, "parallel.schedule": "zb-h1", "memory.recompute": "every:1"},
     "parallel.schedule=zb-h1 with memory.recompute=every:1 with parallel.cp (2) > 1"),
    ({"parallel.cp": 2, "train.log_noise_scale": True}, "train.log_noise_scale with"),
    ({"parallel.cp": 2, "parallel.pp": 2, "parallel.schedule": "pipedream", "train.global_batch": 2,
      "train.micro_batch": 2, "model.tie_embeddings": False}, "parallel.schedule=pipedream with parallel.cp (2) > 1"),
    ({"parallel.cp": 2, "parallel.dp": 2, "parallel.replicas": 2}, "a replica group is data-parallel only"),
    ({"parallel.cp": 2, "memory.recompute": "nth:2"}, "memory.recompute=nth:2 with parallel.cp (2) > 1 is not"),
    ({"parallel.cp": 2, "parallel.cp_mode": "ulysses", "memory.recompute": "ops:matmul"},
     "memory.recompute=ops:matmul with parallel.cp (2) > 1 is not"),
    ({"parallel.cp": 2, "parallel.cp_mode": "ulysses", "model.n_kv_heads": 2, "parallel.tp": 2},
     "model.n_kv_heads (2) / parallel.tp (2) = 1 is not divisible by 2"),
    ({"parallel.cp": 2, "parallel.cp_mode": "ulysses", "model.n_kv_heads": 1, "parallel.tp": 2},
     "model.n_kv_heads (1) copied over parallel.tp (2) leaves 1 per rank, which is not divisible by 2"),
    ({"parallel.cp": 2, "model.moe.experts": 4, "model.moe.group_tokens": 16}, "model.moe.group_tokens (16) to divide"),
    ({"parallel.cp": 2, "parallel.tp": 3, "parallel.sequence_parallel": True, "model.n_heads": 3, "model.d_model": 48},
     "divisible by parallel.tp (3)"),
])
def test_validate_refuses_what_cp_does_not_split_or_compose_with(overrides, fragment):
    cfg = load_config(None, [f"{k}={v}" for k, v in {**TINY, **overrides}.items()])
    with pytest.raises(ConfigError) as e:
        validate(cfg)
    assert fragment in str(e.value) and "\n" not in str(e.value)


def test_world_size_counts_cp_and_the_command_line_says_so_with_exit_2(capsys):
    cfg = load_config(None, [f"{k}={v}" for k, v in {**TINY, "parallel.cp": 2, "parallel.dp": 2}.items()])
    with pytest.raises(ConfigError, match=r"parallel.cp \(2\) = 4 does not match the number of processes \(2\)"):
        validate(cfg, 2)
    assert main(["train", "--nproc", "2", "--set", "parallel.cp=3", "--set", "model.seq_len=32"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "2 x parallel.cp = 6 chunks" in err and "Traceback" not in err


def test_planned_ring_bytes_count_a_key_value_head_copied_over_tp_once_per_rank():
    """n_kv_heads 1 at tp 2: the head is copied on both tp ranks, so each sends a whole head's chunk, as with 2 kv heads
    split over tp 2 (measured through the trainer at cp 2 x tp 2: 131072 bytes per step, as planned)."""
    from scaletrain.plan.analytic.context import step_bytes

    o = {**TINY, "parallel.cp": 2, "parallel.tp": 2, "parallel.sequence_parallel": True}
    copied, split = (step_bytes(make_config({**o, "model.n_kv_heads": kv})).ring for kv in (1, 2))
    head = TINY["model.d_model"] // TINY["model.n_heads"]
    tokens = TINY["train.micro_batch"] * TINY["model.seq_len"] // 2
    micro, layers = TINY["train.global_batch"] // TINY["train.micro_batch"], TINY["model.n_layers"]
    assert copied == split == micro * layers * (2 * (2 * tokens * head * 8) + 2 * 2 * tokens * head * 8)


def test_plan_takes_cp_in_layout_for_a_128k_llama(capsys):
    assert main(["plan", "--model", "llama3-8b", "--gpus", "64", "--seq-len", "131072", "--global-batch", "64",
                 "--layout", "dp=8,cp=8,zero=3,recompute=full", "--json", "--top", "2"]) == 0
    import json

    doc = json.loads(capsys.readouterr().out)
    best = doc["candidates"][0]
    assert best["layout"]["cp"] == 8 and best["layout"]["dp"] == 8 and best["fits"]
    assert best["comm_bytes_per_step"]["cp"] > 0 and best["time_breakdown_s"]["cp_comm"] >= 0


def test_search_picks_cp_for_long_sequences_and_activations_divide_by_cp():
    from scaletrain.plan.analytic.estimate import estimate
    from scaletrain.plan.analytic.inputs import Layout, Training
    from scaletrain.plan.catalog import get_model, with_seq_len
    from scaletrain.plan.hardware import get_gpu
    from scaletrain.plan.search import search

    m, gpu = with_seq_len(get_model("llama3-8b"), 131072), get_gpu("a100-80gb")
    best = search(m, gpu, 64, Training(64)).candidates[0]
    assert best.fits and best.layout.cp > 1  # without cp a 128k sequence's activations do not fit a rank
    acts = [estimate(m, gpu, Training(64), Layout(dp=64 // cp, cp=cp, zero=3, recompute="full"))
            .memory["activations"] for cp in (1, 2, 4)]
    assert acts[0] / acts[1] == pytest.approx(2) and acts[0] / acts[2] == pytest.approx(4)
    short = search(get_model("gpt3-1.3b"), gpu, 64, Training(512))
    assert all(c.layout.cp == 1 for c in short.candidates)  # 2048 tokens: chunks under MIN_CP_CHUNK, not searched
