"""The single-process trainer against independent references (tests/references.py: written from the papers, or
torch's own optimizers), so the layout matrix, which compares every layout with that trainer, inherits the trust:

- Adafactor with the relative step (the paper's schedule) equals `torch.optim.Adafactor`; the settings torch does not
  implement (a constant step size, Tensor2Tensor's first moment) equal the paper's algorithm written with row and
  column sums;
- SM3-II (with and without momentum) equals the paper's algorithm; SGD with momentum equals `torch.optim.SGD`;
- mixture of experts: top-k, Switch and expert choice, with capacity small enough to drop tokens and the balance and
  z-losses weighted to matter, equal a layer computed token by token and group by group (AdamW is torch's);
- all of them in fp64: losses of every step within 1e-12 relative, every final parameter within rtol 1e-10 (four
  steps of fp64 rounding in other summation orders; a wrong formula is off by > 1e-4);
- bf16 and fp16 with fp32 masters and (fp16) dynamic loss scaling equal the paper's loop: the same steps skipped at
  the same scales, losses and parameters equal up to the rounding of one 16-bit ulp (see the test).

AdamW in fp64 against torch's is tests/test_fast_path.py::test_trainer_equals_a_plain_torch_loop_in_fp64.
"""

from __future__ import annotations

import pytest
import torch
from harness import TINY, make_config
from references import PaperAdafactor, PaperSM3, mixed_precision_loop, plain_loop

from scaletrain.train.trainer import Trainer

pytestmark = pytest.mark.usefixtures("one_thread")

RTOL = 1e-10  # fp64, four steps, other summation orders (torch's kernels, sums instead of means)


def _trainer(overrides: dict) -> tuple[dict, dict, list]:
    cfg = make_config(overrides)
    t = Trainer(cfg)
    rows = []
    while t.step < cfg.train.steps:
        t.step += 1
        rows.append(t.train_step(t.step))
    return {r["step"]: r["loss"] for r in rows}, t.full_state(), rows


def _assert_equal(got: tuple[dict, dict], ref: tuple[dict, dict], rtol: float = RTOL) -> None:
    (losses, state), (ref_losses, ref_state) = got, ref
    assert losses.keys() == ref_losses.keys()
    for s in ref_losses:
        assert abs(losses[s] - ref_losses[s]) <= 1e-12 * abs(ref_losses[s]), (s, losses[s], ref_losses[s])
    assert set(ref_state) <= set(state)
    for name, want in ref_state.items():
        torch.testing.assert_close(state[name], want, rtol=rtol, atol=1e-13, msg=lambda m, n=name: f"{n}: {m}")


def test_adafactor_with_the_relative_step_equals_torch_adafactor():
    """torch.optim.Adafactor implements the paper's relative step min(lr, 1/sqrt(t)) with parameter scaling, β̂2t =
    1 - t^-0.8, update clipping d and decoupled decay (lr λ): our optim.relative_step=true. Where they differ: torch
    clamps V̂ at ε1² where we add ε1 = 1e-30 to G² (the paper's placement). That matters only for a gradient element
    near sqrt(ε1) = 1e-15: the key bias, whose true gradient is zero (softmax ignores a per-query constant) and whose
    computed one is rounding (~1e-18), gets a full ±1 entry of U from torch and ~0.001 from us, which changes the
    clipping of the rest of its tensor. Even with the same ε1 its U entry is rounding times 1e15, different in any
    two summation orders; so, as in the layout matrix, the Adafactor and SM3 models here have no biases."""
    over = {**TINY, "optim.name": "adafactor", "optim.relative_step": True, "train.lr": 1e-2, "model.bias": False}
    cfg = make_config(over)
    o = cfg.optim
    ref = plain_loop(cfg, lambda groups: torch.optim.Adafactor(
        groups, lr=cfg.train.lr, beta2_decay=-o.decay_rate, d=o.clip_threshold, eps=(1e-30, 1e-3), foreach=False))
    _assert_equal(_trainer(over)[:2], ref)


@pytest.mark.parametrize("extra", [{}, {"optim.use_beta1": True, "optim.beta1": 0.8}, {"optim.clip_threshold": 1.5}],
                         ids=["default", "first-moment", "clip-1.5"])
def test_adafactor_settings_torch_lacks_equal_the_paper_algorithm(extra):
    """A constant step size (the default, optim.relative_step=false) and a first moment are not in torch's Adafactor:
    the paper's Algorithms 4/5 with sums, written out (references.PaperAdafactor)."""
    over = {**TINY, "optim.name": "adafactor", "model.bias": False, **extra}  # (no biases: see above)
    cfg = make_config(over)
    o = cfg.optim
    ref = plain_loop(cfg, lambda groups: PaperAdafactor(groups, lr=cfg.train.lr, relative=False, decay=o.decay_rate,
                                                        d=o.clip_threshold, beta1=o.beta1 if o.use_beta1 else None))
    _assert_equal(_trainer(over)[:2], ref)


@pytest.mark.parametrize("momentum", [0.0, 0.5])
def test_sm3_equals_the_paper_algorithm(momentum):
    """No biases: SM3's first step on the key bias, whose gradient is rounding (~1e-18), is ±lr in its sign."""
    over = {**TINY, "optim.name": "sm3", "optim.lr_scale": 5.0, "model.bias": False,
            **({"optim.momentum": momentum} if momentum else {})}
    cfg = make_config(over)
    ref = plain_loop(cfg, lambda groups: PaperSM3(groups, lr=cfg.train.lr, momentum=momentum), lr_scale=5.0)
    _assert_equal(_trainer(over)[:2], ref)


def test_sgd_with_momentum_equals_torch_sgd():
    over = {**TINY, "optim.name": "sgd", "optim.momentum": 0.9, "optim.lr_scale": 20.0}
    cfg = make_config(over)
    ref = plain_loop(cfg, lambda groups: torch.optim.SGD(groups, lr=cfg.train.lr, momentum=0.9), lr_scale=20.0)
    _assert_equal(_trainer(over)[:2], ref)


@pytest.mark.parametrize("router", ["topk", "switch", "expert_choice"])
def test_moe_equals_a_token_by_token_layer(router):
    """Capacity factor 1 (top-k: 4 slots per expert for 8 tokens x 2 choices) drops tokens; balance and z-loss
    weights 0.1 and 0.01 (expert choice has no balance loss) make their gradients matter; the trainer's loss
    includes them."""
    over = {**TINY, "train.steps": 3, "train.global_batch": 4, "model.moe.experts": 4, "model.moe.group_tokens": 8,
            "model.moe.router": router,
            # expert choice: capacity 0.5 gives 4 experts fewer slots than 8 tokens, so some token is always untaken
            "model.moe.capacity_factor": 0.5 if router == "expert_choice" else 1.0, "model.moe.z_loss_weight": 0.01,
            **({} if router == "expert_choice" else {"model.moe.aux_loss_weight": 0.1})}
    cfg = make_config(over)
    o = cfg.optim
    ref = plain_loop(cfg, lambda groups: torch.optim.AdamW(groups, lr=cfg.train.lr, betas=(o.beta1, o.beta2),
                                                           eps=o.eps, foreach=False), moe_kind=router)
    losses, state, rows = _trainer(over)
    _assert_equal((losses, state), ref)
    assert sum(r["moe_dropped"] for r in rows) > 0  # capacity did drop assignments


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_mixed_precision_equals_the_papers_loop_bit_for_bit(dtype):
    """fp16: an initial scale of 2^19 overflows (the step is skipped and, with hysteresis 1, the scale halved); clean
    windows of 2 steps double it again, to the next overflow. Both runs use torch's (foreach) AdamW on the fp32
    masters, so what is compared is the mixed-precision machinery: 16-bit model, fp32 accumulation of each
    micro-batch's 16-bit gradients, loss scaling and unscaling, the skip, the scale's schedule, the copy back; every
    loss and every final 16-bit parameter must be equal bit for bit. Without clipping: the trainer's norm and
    torch's clip_grad_norm_ sum in other orders, their last-bit difference in the clip coefficient moves a few fp32
    masters across a 16-bit rounding boundary, and 16-bit training amplifies that (measured in fp16: 3, 63 and 1,325
    of 33,952 parameters one ulp apart after 2, 3 and 6 steps). Clipping itself is compared with torch's in fp64
    (tests/test_fast_path.py)."""
    over = {**TINY, "train.dtype": dtype, "train.steps": 6, "train.grad_clip": 0.0}
    if dtype == "fp16":
        over.update({"train.loss_scale": 2.0**19, "train.loss_scale_window": 2, "train.loss_scale_hysteresis": 1})
    cfg = make_config(over)
    ref_losses, ref_state, scales = mixed_precision_loop(cfg)
    losses, state, rows = _trainer(over)
    if dtype == "fp16":
        assert [(r["step"], r["loss_scale"], r["skipped"]) for r in rows] == scales
        assert scales[0][2] and sum(skipped for _, _, skipped in scales) == 2, scales
    assert losses == ref_losses
    for name, want in ref_state.items():
        assert state[name].dtype == want.dtype and torch.equal(state[name], want), name
