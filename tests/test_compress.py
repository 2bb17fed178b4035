"""Activation compression (Gist, Jain et al., ISCA 2018): the 1-bit ReLU-family masks are lossless,
bf16 / int8 storage stays within stated gradient tolerances, and the measured ratios equal the
bytes computed by hand from the layer sizes."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from scaletrain.config.parse import parse_modes
from scaletrain.errors import ConfigError
from scaletrain.memory import ActivationCompressor, MaskedActivation, pack_bits, unpack_bits

# Relative gradient error ||g - g_ref|| / ||g_ref||, max over all parameters and the input, of an MLP
# whose saved activations are stored in the format. Measured: bf16 ~1.7e-3, int8 ~1e-2 to 1.8e-2.
TOLERANCE = {"bf16": 5e-3, "int8": 4e-2}


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: see conftest.py


def mlp(act, d_in=64, hidden=256, d_out=10, seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(d_in, hidden), act(), nn.Linear(hidden, hidden), act(), nn.Linear(hidden, d_out)
    )


def gradients(model, x, target, comp=None):
    """Gradients of every parameter and of the input; the forward runs under `comp` if given."""
    model.zero_grad()
    x = x.clone().requires_grad_()
    if comp is None:
        loss = F.cross_entropy(model(x), target)
    else:
        with comp:
            loss = F.cross_entropy(model(x), target)
    loss.backward()
    return [p.grad.clone() for p in model.parameters()] + [x.grad]


def rel_error(ref, got):
    return max(((a - b).norm() / a.norm()).item() for a, b in zip(ref, got))


DATA = (torch.randn(32, 64, generator=torch.Generator().manual_seed(1)),
        torch.randint(0, 10, (32,), generator=torch.Generator().manual_seed(2)))


def test_pack_bits_round_trip_uses_one_bit_per_entry():
    mask = torch.rand(3, 7, 5, generator=torch.Generator().manual_seed(0)) > 0.5  # 105 entries
    packed = pack_bits(mask)
    assert packed.dtype == torch.uint8 and packed.numel() == math.ceil(105 / 8) == 14
    assert torch.equal(unpack_bits(packed, mask.shape), mask)


ACTS = {
    "relu": nn.ReLU,
    "leaky_relu": lambda: nn.LeakyReLU(0.1),
    "relu6": nn.ReLU6,
    "hardtanh": lambda: nn.Hardtanh(-0.5, 0.5),
}


@pytest.mark.parametrize("act", list(ACTS))
def test_relu_mask_gives_bit_identical_gradients(act):
    ref_model = mlp(ACTS[act])
    model = copy.deepcopy(ref_model)
    comp = ActivationCompressor("relu-mask")
    assert comp.swap_activations(model) == 2
    assert isinstance(model[1], MaskedActivation)
    ref = gradients(ref_model, *DATA)
    got = gradients(model, *DATA, comp)
    assert all(torch.equal(a, b) for a, b in zip(ref, got))
    # Per slot: a float32 tensor of 32x256 replaced by 32*256/8 bytes.
    k = comp.stats.by_kind["relu-mask"]
    assert (k.tensors, k.bytes_in, k.bytes_out) == (2, 2 * 32 * 256 * 4, 2 * 32 * 256 // 8)
    assert k.ratio == 32.0


@pytest.mark.parametrize("fmt", ["bf16", "int8"])
@pytest.mark.parametrize("act", [nn.GELU, nn.Tanh])
def test_reduced_precision_gradients_within_tolerance(fmt, act):
    ref_model = mlp(act)
    model = copy.deepcopy(ref_model)
    comp = ActivationCompressor(fmt)
    err = rel_error(gradients(ref_model, *DATA), gradients(model, *DATA, comp))
    assert 0 < err < TOLERANCE[fmt], err  # > 0: the saved tensors really were rounded


def test_relu_mask_protects_the_sign_pattern_under_int8():
    """int8 rounds small positive ReLU outputs to 0, which ReLU's own backward reads as 'blocked';
    with relu-mask the mask is exact and only the linear layers see int8 inputs."""
    ref_model = mlp(nn.ReLU)
    ref = gradients(ref_model, *DATA)
    plain = rel_error(ref, gradients(copy.deepcopy(ref_model), *DATA, ActivationCompressor("int8")))
    masked_model = copy.deepcopy(ref_model)
    comp = ActivationCompressor(["relu-mask", "int8"])
    comp.swap_activations(masked_model)
    masked = rel_error(ref, gradients(masked_model, *DATA, comp))
    assert masked < TOLERANCE["int8"] and masked < plain / 3, (masked, plain)


@pytest.mark.parametrize("fmt", ["bf16", "int8"])
def test_ratio_matches_bytes_of_the_saved_tensors(fmt):
    """Linear(64,256) -> GELU -> Linear(256,64), batch 32, input without grad. Autograd keeps the input x
    (leaf: kept), the GELU input h and the second linear's input GELU(h) (each 32x256 fp32: encoded);
    the weights are not counted (parameters)."""
    B, d, H = 32, 64, 256
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(d, H), nn.GELU(), nn.Linear(H, d))
    comp = ActivationCompressor(fmt)
    with comp:
        out = model(torch.randn(B, d))
    x_bytes, act_bytes = B * d * 4, B * H * 4
    act_out = B * H * 2 if fmt == "bf16" else B * H * 1 + 4  # int8 values + one fp32 scale
    k = comp.stats.by_kind[fmt]
    assert (k.tensors, k.bytes_in, k.bytes_out) == (2, 2 * act_bytes, 2 * act_out)
    assert k.ratio == pytest.approx(2.0 if fmt == "bf16" else 4 * B * H / (B * H + 4), rel=1e-12)
    assert comp.stats.bytes_before == x_bytes + 2 * act_bytes
    assert comp.stats.bytes_after == x_bytes + 2 * act_out
    out.sum().backward()  # the encoded tensors decode for backward


def test_a_tensor_saved_twice_is_encoded_once():
    """Tanh keeps its output y (B,T,H); the next Linear keeps a (B*T,H) view of the same storage."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 128), nn.Tanh(), nn.Linear(128, 8))
    x = torch.randn(4, 16, 16)
    ref_model = copy.deepcopy(model)
    comp = ActivationCompressor("int8")
    with comp:
        loss = model(x).square().mean()
    loss.backward()
    k = comp.stats.by_kind["int8"]
    assert (k.tensors, k.bytes_in) == (1, 4 * 16 * 128 * 4)
    ref_model(x).square().mean().backward()
    err = rel_error([p.grad for p in ref_model.parameters()], [p.grad for p in model.parameters()])
    assert 0 < err < TOLERANCE["int8"]


def test_views_at_offsets_decode_to_the_right_entries():
    """q, k, v = qkv.split(...): views at storage offsets 0, 32, 64 of one base, encoded once; a wrong
    offset on decode would feed backward the wrong entries (error ~1, not ~1e-3)."""
    torch.manual_seed(0)
    lin = nn.Linear(32, 96)
    x = torch.randn(2, 40, 32)

    def loss_fn():
        q, k, v = torch.tanh(lin(x)).split(32, dim=-1)
        return ((q @ k.transpose(-1, -2)).softmax(-1) @ v).square().mean()

    loss_fn().backward()
    ref = [p.grad.clone() for p in lin.parameters()]
    lin.zero_grad()
    comp = ActivationCompressor("bf16")
    with comp:
        loss = loss_fn()
    loss.backward()
    assert 0 < rel_error(ref, [p.grad for p in lin.parameters()]) < TOLERANCE["bf16"]


def test_small_tensors_parameters_and_integers_are_kept():
    comp = ActivationCompressor("int8", min_numel=10_000)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4))  # activations 16x32 < 10_000
    with comp:
        F.cross_entropy(model(torch.randn(16, 8)), torch.randint(0, 4, (16,))).backward()
    assert "int8" not in comp.stats.by_kind and comp.stats.ratio == 1.0


def test_attach_compresses_every_forward_and_cleans_up_after_errors():
    model = mlp(nn.ReLU)
    ref = gradients(copy.deepcopy(model), *DATA)
    comp = ActivationCompressor("relu-mask,bf16")
    handles = comp.attach(model)
    got = gradients(model, *DATA)  # no explicit context: the forward hooks enter it
    assert 0 < rel_error(ref, got) < TOLERANCE["bf16"]
    assert set(comp.stats.by_kind) == {"relu-mask", "bf16", "kept"} and not comp._hooks
    with pytest.raises(RuntimeError):
        model(torch.randn(2, 3))  # wrong width: the forward raises, the hooks must still be popped
    assert not comp._hooks
    for h in handles:
        h.remove()


def test_none_mode_measures_what_autograd_saves():
    """With no encoding the stats equal the memory accounting module's saved-activation bytes on a GPT."""
    from scaletrain.config import ModelConfig
    from scaletrain.device.accounting import SavedTensorCounter
    from scaletrain.model.gpt import GPT

    torch.manual_seed(0)
    model = GPT(ModelConfig(n_layers=2, d_model=32, n_heads=2, seq_len=16))
    idx = torch.randint(0, 256, (2, 16))
    counter = SavedTensorCounter(model.parameters())
    with counter.active():
        model(idx)
    comp = ActivationCompressor("none")
    with comp:
        model(idx)
    assert comp.stats.bytes_before == comp.stats.bytes_after == counter.bytes > 0


def test_parse_modes():
    assert parse_modes("none") == frozenset()
    assert parse_modes("relu-mask,int8") == parse_modes(["int8", "relu-mask"]) == {"relu-mask", "int8"}
    assert parse_modes("relu-mask+bf16") == {"relu-mask", "bf16"}
    with pytest.raises(ConfigError, match="fp8"):
        parse_modes("fp8")
    with pytest.raises(ConfigError, match="not both"):
        parse_modes("bf16,int8")
    with pytest.raises(ConfigError, match="none"):
        parse_modes("none,int8")


# ----------------------------------------------------------------------------- int8 blocks (layout independence)


def _int8_roundtrip(x: torch.Tensor, block: int) -> torch.Tensor:
    from scaletrain.memory.compress import _encode

    return _encode(x, "int8", block).decode()


@pytest.mark.parametrize("last", [8, 13, 1])
def test_int8_blocks_hold_each_block_to_half_its_own_step(last):
    """One absmax scale per block of 4 along the last dimension (the last block of a 13-wide row is short):
    every entry is within half its block's step max|x| / 127 / 2, and a block of zeros stays zero."""
    x = torch.randn(6, 5, last, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    x[0, 0] = 0.0
    x[1, 1, :min(last, 4)] *= 1e6  # an outlier block does not widen its neighbours' steps
    got = _int8_roundtrip(x, 4)
    assert got.shape == x.shape and got.is_contiguous() and torch.equal(got[0, 0], x[0, 0])
    for start in range(0, last, 4):
        part = x[..., start:start + 4]
        step = part.abs().amax(-1, keepdim=True) / 127
        assert ((got[..., start:start + 4] - part).abs() <= step / 2 * (1 + 1e-12)).all()


def test_int8_blocks_of_a_tensor_and_of_its_shards_decode_the_same():
    """What makes training compression layout-independent: splitting the last dimension at multiples of the
    block (a tp shard) or the rows (a sequence, micro-batch or expert shard) changes no decoded value."""
    x = torch.randn(4, 6, 48, generator=torch.Generator().manual_seed(4))
    whole = _int8_roundtrip(x, 8)
    assert torch.equal(torch.cat([_int8_roundtrip(c, 8) for c in x.split(16, dim=-1)], dim=-1), whole)
    assert torch.equal(torch.cat([_int8_roundtrip(c, 8) for c in x.split(3, dim=1)], dim=1), whole)
    assert not torch.equal(torch.cat([_int8_roundtrip(c, 0) for c in x.split(16, dim=-1)], dim=-1),
                           _int8_roundtrip(x, 0))  # one scale per tensor: the shards round differently


def test_views_of_a_block_encoded_base_with_a_short_last_block_decode_to_the_right_entries():
    """A view into a base whose rows end in a short block (13 = 8 + 5) is rebuilt from the decoded base with
    the base's strides, so the decoded base must be contiguous (it once was a strided slice of the padding)."""
    comp = ActivationCompressor("int8", min_numel=0, block=8)
    base = torch.randn(6, 13, dtype=torch.float64, requires_grad=True) * 1.0  # has a grad_fn: encoded
    view = base[:, :12].view(6, 4, 3)
    expected = _int8_roundtrip(base.detach(), 8)[:, :12].reshape(6, 4, 3)
    assert torch.equal(comp._pack(view).unpack(), expected)
    assert torch.equal(comp._pack(base).unpack(), _int8_roundtrip(base.detach(), 8))


def test_int8_block_divides_every_width_tensor_parallelism_splits():
    from scaletrain.config import ModelConfig
    from scaletrain.config.sizes import ffn_size
    from scaletrain.memory.compress import int8_block

    for d, h, mlp in ((32, 4, "gelu"), (128, 4, "swiglu"), (720, 12, "gelu"), (12288, 96, "gelu"),
                      (96, 6, "swiglu")):
        cfg = ModelConfig(d_model=d, n_heads=h, mlp=mlp)
        b, ff = int8_block(cfg), ffn_size(cfg)
        legal = [tp for tp in range(1, h + 1) if h % tp == 0 and d % tp == 0 and ff % tp == 0]
        assert 1 <= b <= 64 and (d // h) % b == 0
        assert all((d // tp) % b == 0 and (ff // tp) % b == 0 for tp in legal), (d, h, b)
    assert int8_block(ModelConfig(d_model=720, n_heads=12)) == 60  # not only powers of two


def test_int8_router_losses_of_some_dispatch_groups_give_the_gradients_they_give_among_all():
    """The two-level router's balancing losses (model/moe_gating.py) hold one number per dispatch group in
    one-dimensional tensors (each group's CV² and mean²). A context- or sequence-parallel rank holds some of the
    groups, one process all of them. Under the engine's int8 settings (block 8, every size, leaves) the gradients
    of the first and of the last four of eight groups equal, bit for bit, those of the eight together: such a
    tensor is kept, not scaled by the absmax of other groups' entries (issue 29: cp2 x int8 x hierarchical)."""
    from scaletrain.model.moe_gating import hierarchical_importance_load_sum

    g = torch.Generator().manual_seed(5)
    G, S, a, b = 8, 8, 2, 2
    gates = torch.rand(G, S, a, b, dtype=torch.float64, generator=g)
    primary = torch.rand(G, S, a, dtype=torch.float64, generator=g)
    secondary = torch.rand(G, S, a, b, dtype=torch.float64, generator=g)
    chosen = torch.rand(G, S, a, generator=g) > 0.5

    def grads(part: slice) -> list[torch.Tensor]:
        leaves = [t[part].clone().requires_grad_() for t in (gates, primary, secondary)]
        comp = ActivationCompressor("int8", min_numel=0, block=8, leaves=True)
        with comp:
            inputs = [t * 1.0 for t in leaves]  # activations (a grad_fn), as in the model
            loss = hierarchical_importance_load_sum(*inputs[:3], chosen[part], 1.0, 0.5)
        loss.backward()
        assert comp.stats.by_kind["int8"].tensors > 0  # the router's other saved tensors are encoded
        return [t.grad for t in leaves]

    whole, first, last = grads(slice(None)), grads(slice(0, G // 2)), grads(slice(G // 2, G))
    for w, f, la in zip(whole, first, last):
        assert torch.equal(torch.cat([f, la]), w)



def test_rope_returns_a_tensor_of_its_own_equal_bit_for_bit_to_the_stacked_rotation():
    """Attention saves RoPE's q and k; int8 scales blocks along the last dimension of the stored tensor. As a view
    of a (..., hs/2, 2) stack their blocks were pairs in one process and heads under Ulysses (the all-to-all's own
    (..., hs) tensor). Now RoPE's output is its own (..., hs) tensor, with the stacked form's values and
    gradients."""
    from scaletrain.model.rope import apply_rope, rope_tables

    cos, sin = (t.double() for t in rope_tables(16, 8))
    qkv = torch.randn(2, 16, 3, 4, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    outs, grads = [], []
    for stacked in (True, False):
        x = qkv.clone().requires_grad_()
        q = x.permute(2, 0, 3, 1, 4)[0]  # (B, nh, T, hs), a strided view as in the model
        if stacked:
            x1, x2 = q[..., 0::2], q[..., 1::2]
            y = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)
        else:
            y = apply_rope(q, cos, sin)
            assert y._base is None and y.is_contiguous() and y.shape == q.shape
        (y * torch.linspace(-1, 1, y.numel(), dtype=torch.float64).view(y.shape)).sum().backward()
        outs.append(y.detach())
        grads.append(x.grad)
    assert torch.equal(outs[0], outs[1]) and torch.equal(grads[0], grads[1])


# Issue 29's int8 layouts at two processes, fp64, against one process: every step's loss and every final parameter
# within rtol 1e-9, atol 1e-12 (test_context_parallel.py's bounds, set before measuring). Measured: losses 1.7e-16
# relative, parameters 6.1e-16 absolute apart at most.
TWO_LEVEL = {"model.moe.experts": 4, "model.moe.group_tokens": 8, "model.moe.aux_loss": "importance",
             "model.moe.router_noise": 0.5, "model.moe.groups": 2, "model.moe.top_k": 1}
INT8_LAYOUTS = {
    # the 8-process FAIL of docs/verify.md at cp 2 x pp 1: the router's per-group losses (one-dimensional) were
    # scaled per shard (before: loss 2.5e-5, parameters 6e-3 apart)
    "two-level router, attn-core": {**TWO_LEVEL, "memory.recompute": "attn-core", "model.dropout": 0.1},
    # RoPE's q and k saved by attention, as pairs in one process and as heads after Ulysses' all-to-all
    "rope, no recomputation": {"model.dropout": 0.0},
}
INT8_COMMON = {"memory.compress": "int8", "model.position": "rope", "train.steps": 3, "train.global_batch": 4}
ULYSSES = {"parallel.cp": 2, "parallel.cp_mode": "ulysses"}


@pytest.fixture(scope="module")
def int8_layout_runs():
    from harness import train_parallel_many, train_reference

    cases = [{**INT8_COMMON, **o} for o in INT8_LAYOUTS.values()]
    refs = [train_reference(c) for c in cases]
    pars = train_parallel_many([{**c, **ULYSSES} for c in cases], 2)
    return dict(zip(INT8_LAYOUTS, zip(refs, pars)))


@pytest.mark.parametrize("name", list(INT8_LAYOUTS))
def test_int8_compressed_cp2_ulysses_matches_one_process(int8_layout_runs, name):
    from harness import assert_same_run

    ref, par = int8_layout_runs[name]
    assert_same_run(ref, par, 1e-9, 1e-12)
