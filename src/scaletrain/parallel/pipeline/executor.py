"""Run one pipeline rank's action list: forwards, backwards and batched point-to-point messages.

The list comes from `schedules.build_schedule` and follows its send/recv convention: a maximal run of
consecutive SEND/RECV actions is posted as one `torch.distributed.batch_isend_irecv`, its receives are
waited for before the next compute action, and a send is waited for only when its buffer may be freed
(polled between batches, all of them at the end of the step). Activation and gradient shapes are known
from the config, so no shape is ever exchanged. Each compute action is a method of a small dispatch
table (DeepSpeed's instruction -> method map).

- Megatron's deallocation trick (arXiv 2104.04473): once a stage output is handed to isend, the output
  tensor's data is replaced by an empty tensor; the send keeps the storage alive only until it completes.
  The later backward starts from the output's autograd edge (`GradientEdge`), which needs no data.
- Zero bubble's split backward (Qi et al., arXiv 2401.10241): BACKWARD_INPUT computes only the gradient
  of the stage input, while pre-hooks capture the gradient arriving at every autograd node that also
  feeds a weight; BACKWARD_WEIGHT later replays just those nodes towards the weights. The graph walk is
  generic (any module), so no layer has to be rewritten for it.
- Tied embeddings (see stage.py): the first stage sends the weight to the last stage's copy at the start
  of every step and evaluation; the last stage sends the copy's gradient back at the end of its list,
  and the first stage adds it before its last weight-gradient pass. Both messages use their own tags,
  so they never match a schedule message.
- Loss: the last stage computes loss_sum(logits, y) * scale per microbatch, exactly the single-process
  normalisation, and the step's sum is broadcast to every pipeline rank.
- Data parallelism: `optimizer.begin_micro(i, n)` is called before each pass that produces weight
  gradients (n = microbatches x chunks), so the reducer communicates on the last one only.
- PipeDream-2BW (arXiv 2006.09503): asynchronous 1F1B. Each call runs `schedules.build_2bw_step`'s
  list: batch t's remaining passes, reading W(t-1), and, unless the engine asks to drain
  (`engine.next_micro` is None), batch t+1's first forwards, reading W(t) (stage 0 fetches their
  micro-batches through `engine.next_micro()`). Their activations stay on the executor until the next
  call. `WeightVersions` keeps the two versions and hands the optimizer the buffer W(t+1) may be written
  into; the optimizer applies the batch-t gradient to W(t): W(t+1) = W(t) - lr * grad f(W(t-1)).
- PipeDream (arXiv 1806.03377): each call runs `pipedream.build_pipedream_step`'s list (one minibatch per
  step: the forward of minibatch t + p - r - 1, the backward of minibatch t); `stash.WeightStash` points the
  parameters at the version each pass reads and writes the version log. With vertical sync the version stage 0
  read travels with the activation (one int64 message after it, to the same peer).

Measured per step: every compute action's start and end (`last_events`), the peak number of
(microbatch, chunk) pairs held, and on the first step the peak bytes saved for backward.
"""

from __future__ import annotations

import json
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.autograd.graph import GradientEdge, get_gradient_edge

from scaletrain.device.accounting import SavedTensorCounter
from scaletrain.distributed.comm import CommStats
from scaletrain.parallel.pipeline.pipedream import build_pipedream_step
from scaletrain.parallel.pipeline.schedules import (
    Action,
    Op,
    batches,
    build_2bw_step,
    rank_chunk_to_stage,
    stage_to_rank_chunk,
    unfold,
)
from scaletrain.parallel.pipeline.simulate import Event
from scaletrain.parallel.pipeline.stash import WeightStash
from scaletrain.parallel.pipeline.trace import PipelineTrace

Key = tuple[int, int]  # (microbatch, local chunk)
TAG_TIED_VALUE, TAG_TIED_GRAD = 1, 2  # schedule messages use tag 0


def forward_only(actions: list[Action]) -> list[Action]:
    """The forward part of a rank's list (forwards and activation messages), for evaluation."""
    return [a for a in unfold(actions) if a.op in (Op.FORWARD, Op.SEND_ACT, Op.RECV_ACT)]


@dataclass
class _Step:
    """State of one executed action list."""

    micro: list[tuple[torch.Tensor, torch.Tensor]]
    scale: float
    loss: torch.Tensor
    inputs: dict[Key, torch.Tensor] = field(default_factory=dict)  # received activations (leaves)
    outputs: dict[Key, torch.Tensor] = field(default_factory=dict)  # stage outputs, or scaled losses
    boundary: dict[Key, torch.Tensor] = field(default_factory=dict)  # what the input-gradient pass targets
    grads_in: dict[Key, torch.Tensor] = field(default_factory=dict)  # received output gradients
    grads_out: dict[Key, torch.Tensor] = field(default_factory=dict)  # input gradients to send
    weight_work: dict[Key, list] = field(default_factory=dict)  # deferred weight passes (zero bubble)
    pending: list = field(default_factory=list)  # (work, buffer) of sends not known complete
    tied_grad: tuple | None = None  # (work, buffer): the last stage's tied-weight gradient, on stage 0
    events: list[Event] = field(default_factory=list)
    weight_passes: int = 0
    held: int = 0
    peak: int = 0
    saved: dict[Key, int] = field(default_factory=dict)
    saved_peak: int = 0
    measure: bool = False  # count the bytes each forward saves for backward
    t0: float = 0.0  # perf_counter at the start of the step
    wall0: float = 0.0  # time.time() at the same instant: comparable across processes
    next_micro: object = None  # 2BW, PipeDream: (k) -> step + k's micro-batches (called once, when needed)
    next_data: dict = field(default_factory=dict)
    pd: dict[Key, tuple] = field(default_factory=dict)  # PipeDream: (version, autograd counters) of a forward
    pd_vin: dict[Key, torch.Tensor] = field(default_factory=dict)  # vertical sync: the version received
    step: int = 0  # the optimizer step (dropout masks of batch b are those of step + b)

    def data(self, batch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        if batch == 0:
            return self.micro
        if batch not in self.next_data:
            self.next_data[batch] = self.next_micro(batch)
        return self.next_data[batch]


class PipelineExecutor:
    """Executes this rank's schedule each step; `run` and `run_eval` are the engine's runners."""

    def __init__(self, stages: nn.Module, actions: list[Action], schedule: str, rank: int, p: int, m: int,
                 v: int, group, peers: list[int], act_shape: tuple[int, ...], comm: CommStats | None = None,
                 tied: bool = False, trace_call: int = 2, vertical_sync: bool = False):
        self.stages, self.schedule, self.rank, self.p, self.m, self.v = stages, schedule, rank, p, m, v
        self.group, self.peers, self.act_shape, self.comm = group, peers, tuple(act_shape), comm
        self.tied_role = None  # "first" (owns wte.weight) or "last" (holds the copy)
        if tied and stages.has_first and not stages.has_last:
            self.tied_role, self.tied_tensor, self.tied_peer = "first", stages.wte.weight, peers[-1]
        elif tied and getattr(stages, "tied_copy", None) is not None:
            self.tied_role, self.tied_tensor, self.tied_peer = "last", stages.tied_copy, peers[0]
        self.actions = actions = unfold(actions)  # DualPipeV's overlapped slot: its two halves one after the other
        self.steps = batches(actions)
        self.eval_steps = batches(forward_only(actions))
        self.n_stages = p * v
        self.params = [list(stages.chunk_params(c)) for c in range(v)]
        first = next(iter(stages.parameters()))
        self.dtype, self.device = first.dtype, first.device
        self.versions = WeightVersions(list(stages.parameters())) if schedule == "2bw" else None
        self._vertical = vertical_sync and schedule == "pipedream"
        self.stash = WeightStash(list(stages.parameters()), rank, vertical_sync) if schedule == "pipedream" else None
        self._2bw_steps: dict[tuple[bool, bool], list[list[Action]]] = {}
        self.carry: _Step | None = None  # 2BW: state of the next batch's microbatches already started
        self.last_wall0 = 0.0  # time.time() at the start of the last step (last_events are relative to it)
        self.calls = 0
        self.trace_call = trace_call
        self.trace: PipelineTrace | None = None  # the gathered measured timeline (pipeline rank 0)
        self.last_events: list[Event] = []
        self.last_peak_in_flight = 0
        self.activation_bytes = 0
        self._compute = {
            Op.FORWARD: self._forward,
            Op.BACKWARD: self._backward,
            Op.BACKWARD_INPUT: self._backward_input,
            Op.BACKWARD_WEIGHT: self._backward_weight,
        }

    # ------------------------------------------------------------------ runners

    def run(self, engine, micro: list[tuple[torch.Tensor, torch.Tensor]], scale: float) -> torch.Tensor:
        """One training step's forward and backward; returns the loss (same value on every pipeline rank; PipeDream:
        the last stage's value, 0 on the others, until the trainer's `share_rows` at a logged step)."""
        if len(micro) != self.m:
            raise ValueError(f"pipeline schedule expects {self.m} microbatches, got {len(micro)}")
        self.calls += 1
        tracing = self.calls == self.trace_call
        measure = self.calls == 1
        st = _Step(micro, scale, torch.zeros((), dtype=torch.float64, device=self.device), measure=measure,
                   step=engine.dropout.step if engine.dropout is not None else 0)
        steps, overlap = self.steps, False
        if self.versions is not None:  # PipeDream-2BW: continue the previous step's next batch, start ours
            st.next_micro = getattr(engine, "next_micro", None)
            overlap = st.next_micro is not None
            steps = self._steps_2bw(first=self.carry is None, last=not overlap)
            self._take_carry(st)
            self.versions.begin_run()
            self.versions.use(0)
        if self.stash is not None:  # PipeDream: this step's minibatch and the forward of a later one
            st.next_micro = getattr(engine, "next_micro", None)
            overlap = st.next_micro is not None
            steps = self._steps_pipedream(first=self.carry is None, last=not overlap)
            self._take_carry(st)
            self.stash.begin(engine.step)
        if tracing and self.group is not None:
            dist.barrier(group=self.group)  # a common time origin for the gathered timeline
        st.t0, st.wall0 = time.perf_counter(), time.time()
        engine.optimizer.begin_step()  # ZeRO-3: gather this stage's parameters for the step
        self._tied_start(st, train=True)
        for step in steps:
            if step[0].op.is_comm:
                self._communicate(step, st)
            else:
                if self.versions is not None:
                    self.versions.use(step[0].batch)
                if self.stash is not None:
                    self._stash_point(step[0], st, engine.step)
                self._timed(step[0], st, engine)
        if self.tied_role == "last":  # the copy's gradient goes back to the owner
            grad = self.tied_tensor.grad
            st.pending.append((dist.isend(grad, self.tied_peer, group=self.group, tag=TAG_TIED_GRAD), grad))
        self._wait_sends(st)
        engine.optimizer.finish_backward()
        if self.versions is not None:
            self.versions.end_run(in_flight=overlap)
            self.carry = st if overlap else None
        if self.stash is not None:
            self.stash.end({v for v, _ in st.pd.values()} if overlap else set())
            self.carry = st if overlap else None
        # PipeDream: no collective across stages in a step; the loss stays on the last stage (`share_rows`)
        loss = self._share_loss(st.loss) if self.stash is None else st.loss
        self.last_events, self.last_peak_in_flight, self.last_wall0 = st.events, st.peak, st.wall0
        if measure:
            self.activation_bytes = engine.activation_bytes = st.saved_peak
        if tracing:
            self.trace = self._gather_trace(st)
        return loss

    @torch.no_grad()
    def run_eval(self, engine, micro: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
        """Forward-only pipeline; returns the summed token loss (same value on every pipeline rank)."""
        self.stages.eval()
        st = _Step(micro, 1.0, torch.zeros((), dtype=torch.float64, device=self.device))
        try:
            with engine.optimizer.params_gathered():  # ZeRO-3: for the evaluation
                self._tied_start(st, train=False)
                for step in self.eval_steps:
                    if step[0].op.is_comm:
                        self._communicate(step, st)
                    else:
                        self._forward(step[0], st, engine)
                self._wait_sends(st)
        finally:
            self.stages.train()
        return float(self._share_loss(st.loss))

    def _steps_2bw(self, first: bool, last: bool) -> list[list[Action]]:
        if (first, last) not in self._2bw_steps:
            self._2bw_steps[(first, last)] = batches(build_2bw_step(self.p, self.m, first, last)[self.rank])
        return self._2bw_steps[(first, last)]

    def _steps_pipedream(self, first: bool, last: bool) -> list[list[Action]]:
        if (first, last) not in self._2bw_steps:
            self._2bw_steps[(first, last)] = batches(build_pipedream_step(self.p, first, last)[self.rank])
        return self._2bw_steps[(first, last)]

    def _stash_point(self, a: Action, st: _Step, step: int) -> None:
        """PipeDream: point the parameters at the version this forward or backward reads (weight stashing)."""
        key = self._key(a)
        if a.op is Op.FORWARD:
            vin = st.pd_vin.pop(key, None)
            st.pd[key] = self.stash.forward(step + a.batch, None if vin is None else int(vin), later=a.batch > 0)
        else:
            version, counters = st.pd.pop(key)
            self.stash.backward(step + a.batch, version, counters)

    def _take_carry(self, st: _Step) -> None:
        """Move the previous step's next-batch state (keys m + i) into this step as batch 0 (keys i)."""
        prev, self.carry = self.carry, None
        if prev is None:
            return
        for name in ("inputs", "outputs", "boundary", "saved", "pd", "pd_vin"):
            src, dst = getattr(prev, name), getattr(st, name)
            for (mb, c), value in src.items():
                if mb < self.m:
                    raise RuntimeError(f"2BW carry: microbatch {mb} of the finished batch is still held")
                dst[(mb - self.m, c)] = value
        st.held = st.peak = prev.held

    def write_trace(self, out_dir: str | Path) -> list[Path]:
        """Write the measured timeline (JSON + PNG) into out_dir; only the rank holding it writes. PipeDream: every
        rank also writes its version log, out_dir/pipedream_versions/rank<global rank>.jsonl, and the names of the
        parameters its stage holds beside it (rank<global rank>.params.json)."""
        if self.stash is not None:
            rank = dist.get_rank() if dist.is_initialized() else 0
            log = self.stash.write_log(Path(out_dir) / "pipedream_versions" / f"rank{rank}.jsonl")
            names = {"stage": self.rank, "params": [n for n, _ in self.stages.named_parameters()]}
            log.with_suffix(".params.json").write_text(json.dumps(names))  # which stage holds what (the replay)
            logged = [log, log.with_suffix(".params.json")]
            return logged + self._write_timeline(out_dir)
        return self._write_timeline(out_dir)

    def _write_timeline(self, out_dir: str | Path) -> list[Path]:
        if self.trace is None or (dist.is_initialized() and dist.get_rank() != 0):
            return []
        return self.trace.save(out_dir)

    # ------------------------------------------------------------------ compute

    def _timed(self, a: Action, st: _Step, engine) -> None:
        t = time.perf_counter()
        self._compute[a.op](a, st, engine)
        mb = a.microbatch + a.batch * self.m  # microbatches >= m: the next step's (2BW)
        st.events.append(Event(self.rank, a.op.value, t - st.t0, time.perf_counter() - st.t0, mb, a.chunk))

    def _stage(self, chunk: int) -> int:
        return rank_chunk_to_stage(self.rank, chunk, self.p, self.schedule)

    def _local_chunk(self, stage: int) -> int | None:
        """This rank's local chunk holding `stage`, or None when another rank holds it (the V's tip: stages
        p-1 and p share rank p-1 and hand tensors over in memory, convention point 3)."""
        if not 0 <= stage < self.n_stages:
            return None
        r, c = stage_to_rank_chunk(stage, self.p, self.schedule)
        return c if r == self.rank else None

    def _hand_over(self, a: Action, s: int, out: torch.Tensor, st: _Step) -> None:
        """Forward output to the next stage on this rank: its input, cut from this chunk's graph."""
        c = self._local_chunk(s + 1)
        if c is not None:
            st.inputs[(a.microbatch + a.batch * self.m, c)] = out.detach().requires_grad_(torch.is_grad_enabled())

    def _hand_back(self, a: Action, s: int, st: _Step) -> None:
        """Input gradient to the previous stage on this rank (its output gradient)."""
        c = self._local_chunk(s - 1)
        if c is not None:
            st.grads_in[(a.microbatch + a.batch * self.m, c)] = st.grads_out.pop(self._key(a))

    def _key(self, a: Action) -> Key:
        """Where a microbatch's tensors are kept: the next step's microbatch i (2BW) under m + i."""
        return a.microbatch + a.batch * self.m, a.chunk

    def _forward(self, a: Action, st: _Step, engine) -> None:
        key, s = self._key(a), self._stage(a.chunk)
        x, y = st.data(a.batch)[a.microbatch]
        if engine.dropout is not None and torch.is_grad_enabled():  # this micro-batch's dropout masks
            engine.dropout.at_micro(a.microbatch, x.shape[0], st.step + a.batch)
        if s > 0:
            x = st.inputs[key] if torch.is_grad_enabled() else st.inputs.pop(key)
        counter = SavedTensorCounter(self.stages.parameters()) if st.measure else None
        with counter.active() if counter is not None else nullcontext():
            out, boundary = self.stages.forward_chunk(a.chunk, x)
            out = self._loss(engine, out, y, st) if s == self.n_stages - 1 else out
        if s < self.n_stages - 1:
            self._hand_over(a, s, out, st)
        if not torch.is_grad_enabled():  # evaluation: nothing is kept for a backward
            if s < self.n_stages - 1 and self._local_chunk(s + 1) is None:
                st.outputs[key] = out
            return
        st.outputs[key], st.boundary[key] = out, boundary
        st.held += 1
        st.peak = max(st.peak, st.held)
        if counter is not None:
            st.saved[key] = counter.bytes
            st.saved_peak = max(st.saved_peak, sum(st.saved.values()))

    def _loss(self, engine, logits: torch.Tensor, y: torch.Tensor, st: _Step) -> torch.Tensor:
        loss = engine.loss_fn(logits, y)
        if torch.is_grad_enabled():
            loss = loss * st.scale
        st.loss += loss.detach()
        return loss

    def _release(self, key: Key, st: _Step) -> None:
        st.held -= 1
        st.saved.pop(key, None)

    def _begin_weight_pass(self, st: _Step, engine) -> None:
        """Before a pass that accumulates weight gradients: data parallelism syncs on the last one only."""
        n = self.m * self.v
        if st.weight_passes == n - 1 and st.tied_grad is not None:  # complete the tied gradient first
            work, buf = st.tied_grad
            work.wait()
            w = self.tied_tensor
            if w.grad is None:
                w.grad = buf
            else:
                w.grad += buf
            st.tied_grad = None
        engine.optimizer.begin_micro(st.weight_passes, n)
        st.weight_passes += 1

    def _backward(self, a: Action, st: _Step, engine) -> None:
        """Full backward: input and weight gradients in one autograd pass."""
        key, s = self._key(a), self._stage(a.chunk)
        self._begin_weight_pass(st, engine)
        out = st.outputs.pop(key)
        st.boundary.pop(key)
        if s == self.n_stages - 1:
            torch.autograd.backward(out)
        else:
            torch.autograd.backward(get_gradient_edge(out), st.grads_in.pop(key))
        if s > 0:
            st.grads_out[key] = st.inputs.pop(key).grad
            self._hand_back(a, s, st)
        self._release(key, st)

    def _backward_input(self, a: Action, st: _Step, engine) -> None:
        """Zero bubble's B: the input gradient only; remember what the weight pass needs."""
        key, s = self._key(a), self._stage(a.chunk)
        out, boundary = st.outputs.pop(key), st.boundary.pop(key)
        last = s == self.n_stages - 1
        root = out if last else get_gradient_edge(out)
        grad = None if last else st.grads_in.pop(key)
        groups, embed_params = weight_groups(out.grad_fn, boundary, self.params[a.chunk])
        captured: dict = {}
        handles = [n.register_prehook(_capture(captured, n)) for g in groups for n in g[0]]
        try:
            (dx,) = torch.autograd.grad([root], [boundary], [grad], retain_graph=True)
        finally:
            for h in handles:
                h.remove()
        work = []
        for nodes, params in groups:
            edges, grads = [], []
            for n in nodes:
                for i, gr in enumerate(captured.get(n, ())):
                    if gr is not None:
                        edges.append(GradientEdge(n, i))
                        grads.append(gr)
            if edges:
                work.append((edges, grads, params))
        if s == 0:
            if embed_params:  # the embeddings sit below the boundary: replay from it with its gradient
                work.append(([get_gradient_edge(boundary)], [dx], embed_params))
        else:
            st.grads_out[key] = dx
            st.inputs.pop(key)
            self._hand_back(a, s, st)
        st.weight_work[key] = work

    def _backward_weight(self, a: Action, st: _Step, engine) -> None:
        """Zero bubble's W: weight gradients from the gradients captured by BACKWARD_INPUT."""
        key = self._key(a)
        self._begin_weight_pass(st, engine)
        for edges, grads, params in st.weight_work.pop(key):
            torch.autograd.backward(edges, grads, inputs=params)
        self._release(key, st)

    # ------------------------------------------------------------------ communication

    def _communicate(self, step: list[Action], st: _Step) -> None:
        """Post one batch of sends and receives together; wait for the receives only."""
        ops, recvs, sends = [], [], []
        for a in step:
            key, peer = self._key(a), self.peers[a.peer]
            if a.op is Op.SEND_ACT:
                out = st.outputs[key]
                buf = out.detach().contiguous()
                ops.append(dist.P2POp(dist.isend, buf, peer, self.group))
                sends.append(buf)
                if self._vertical and torch.is_grad_enabled():  # the version travels with the activation
                    ver = torch.tensor([st.pd[key][0]], dtype=torch.int64, device=self.device)
                    ops.append(dist.P2POp(dist.isend, ver, peer, self.group))
                    sends.append(ver)
                if torch.is_grad_enabled():
                    out.data = torch.empty(0, dtype=out.dtype, device=out.device)  # Megatron's deallocation
                else:
                    st.outputs.pop(key)
            elif a.op is Op.SEND_GRAD:
                buf = st.grads_out.pop(key).contiguous()
                ops.append(dist.P2POp(dist.isend, buf, peer, self.group))
                sends.append(buf)
            else:
                buf = torch.empty(self.act_shape, dtype=self.dtype, device=self.device)
                ops.append(dist.P2POp(dist.irecv, buf, peer, self.group))
                recvs.append((a, key, buf))
                if a.op is Op.RECV_ACT and self._vertical and torch.is_grad_enabled():
                    ver = torch.empty(1, dtype=torch.int64, device=self.device)
                    ops.append(dist.P2POp(dist.irecv, ver, peer, self.group))
                    recvs.append((None, key, ver))
        works = dist.batch_isend_irecv(ops)
        if self.comm is not None:
            for buf in sends:
                self.comm.add("p2p", buf.numel() * buf.element_size())
        send_works = [w for w, o in zip(works, ops) if o.op is dist.isend]
        recv_works = [w for w, o in zip(works, ops) if o.op is dist.irecv]
        st.pending += list(zip(send_works, sends))
        for w, (a, key, buf) in zip(recv_works, recvs):
            w.wait()
            if a is None:
                st.pd_vin[key] = buf
            elif a.op is Op.RECV_ACT:
                st.inputs[key] = buf.requires_grad_(torch.is_grad_enabled())
            else:
                st.grads_in[key] = buf
        st.pending = [(w, b) for w, b in st.pending if not w.is_completed()]  # frees finished buffers

    def _tied_start(self, st: _Step, train: bool) -> None:
        """Send the tied weight to the last stage (which waits for it); post the gradient's receive."""
        if self.tied_role == "first":
            w = self.tied_tensor.detach()
            st.pending.append((dist.isend(w, self.tied_peer, group=self.group, tag=TAG_TIED_VALUE), w))
            if train:
                buf = torch.empty_like(w)
                st.tied_grad = (dist.irecv(buf, self.tied_peer, group=self.group, tag=TAG_TIED_GRAD), buf)
            if self.comm is not None:
                self.comm.add("p2p", w.numel() * w.element_size())
        elif self.tied_role == "last":
            w = self.tied_tensor
            dist.recv(w.detach(), self.tied_peer, group=self.group, tag=TAG_TIED_VALUE)
            w.grad = None
            if train and self.comm is not None:
                self.comm.add("p2p", w.numel() * w.element_size())

    def _wait_sends(self, st: _Step) -> None:
        for w, _ in st.pending:
            w.wait()
        st.pending.clear()

    def share_rows(self, rows: list[dict]) -> None:
        """PipeDream, at a logged step only: the loss of every step since the last one (the last stage's) and the
        gradient norm of the whole model (each stage's norm squared, summed over stages) on every pipeline rank, in
        one all-reduce over the pipeline group: rows[i]["loss"], rows[i]["grad_norm"] in place."""
        if not rows:
            return
        last = self.rank == stage_to_rank_chunk(self.n_stages - 1, self.p, self.schedule)[0]
        zero = torch.zeros((), dtype=torch.float64, device=self.device)
        losses = [torch.as_tensor(r["loss"], dtype=torch.float64, device=self.device) if last else zero for r in rows]
        norms = [torch.as_tensor(r["grad_norm"], dtype=torch.float64, device=self.device).square() for r in rows]
        both = torch.stack([torch.stack(losses), torch.stack(norms)])
        if self.group is not None:
            dist.all_reduce(both, group=self.group)
        for r, loss, sq in zip(rows, both[0], both[1]):
            r["loss"], r["grad_norm"] = loss, sq.sqrt()

    def _share_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The last stage's loss sum on every pipeline rank."""
        if self.group is not None:
            last = stage_to_rank_chunk(self.n_stages - 1, self.p, self.schedule)[0]  # rank 0 in a V
            dist.broadcast(loss, src=self.peers[last], group=self.group)
        return loss

    def _gather_trace(self, st: _Step) -> PipelineTrace | None:
        """All pipeline ranks' events of this step on rank 0, on the wall clock (processes' perf_counter
        origins differ; leaving a barrier differs by the wake-up latency)."""
        events = [Event(e.rank, e.name, st.wall0 + e.start_s, st.wall0 + e.end_s, e.microbatch, e.chunk)
                  for e in st.events]
        parts: list = [None] * self.p
        if self.group is not None:
            dist.all_gather_object(parts, events, group=self.group)
        else:
            parts = [events]
        if self.rank != 0:
            return None
        return PipelineTrace(self.schedule, self.p, self.m, self.v, [e for part in parts for e in part])


# --------------------------------------------------------------------------- zero bubble's graph split


def _capture(store: dict, node):
    def hook(grad_outputs):
        store[node] = grad_outputs

    return hook


def _children(node) -> list:
    return [c for c, _ in node.next_functions if c is not None]


def weight_groups(root_node, boundary: torch.Tensor, params: list[nn.Parameter]):
    """Split the autograd graph from `root_node` to `boundary` for zero bubble's input / weight passes.

    Returns (groups, embed_params). Each group is (nodes, params): nodes on the root -> boundary path
    that also feed some weights only through nodes off that path, and those weights (groups sharing a
    weight are merged). Capturing the gradient at these nodes during the input pass and replaying each
    group towards its own weights reproduces the weight gradients exactly, without recomputing the
    input path. `embed_params` are the weights below the boundary (stage 0's embeddings).
    """
    b_node = get_gradient_edge(boundary).node
    pnode = {get_gradient_edge(p).node: p for p in params}
    # Post-order walk (children first), not descending below the boundary.
    reaches: dict = {}
    stack = [(root_node, False)]
    while stack:
        n, expanded = stack.pop()
        if n in reaches:
            continue
        if n is b_node:
            reaches[n] = True
            continue
        kids = _children(n)
        if expanded:
            reaches[n] = any(reaches.get(c, False) for c in kids)
            continue
        stack.append((n, True))
        stack += [(c, False) for c in kids if c not in reaches]

    def params_below(start) -> set:
        found, seen, todo = set(), set(), [start]
        while todo:
            n = todo.pop()
            if n in seen:
                continue
            seen.add(n)
            if n in pnode:
                found.add(pnode[n])
            todo += _children(n)
        return found

    groups: list[tuple[list, set]] = []
    for n, on_path in reaches.items():
        if not on_path or n is b_node:
            continue
        ps: set = set()
        for c in _children(n):
            if not reaches.get(c, False):
                ps |= params_below(c)
        if ps:
            groups.append(([n], ps))
    merged: list[tuple[list, set]] = []
    for nodes, ps in groups:  # union groups that share a weight
        for other in [g for g in merged if g[1] & ps]:
            merged.remove(other)
            nodes, ps = other[0] + nodes, other[1] | ps
        merged.append((nodes, ps))
    order = {id(p): i for i, p in enumerate(params)}
    out = [(nodes, sorted(ps, key=lambda p: order[id(p)])) for nodes, ps in merged]
    embed = sorted(params_below(b_node) if b_node not in pnode else set(), key=lambda p: order[id(p)])
    both = {id(p) for p in embed} & {id(p) for _, ps in out for p in ps}
    if both:  # replaying its group would run back through the boundary and count it twice
        raise ValueError("a weight is used on both sides of the stage boundary (tied embeddings on one stage);"
                         " the split backward needs them on different stages")
    return out, embed


# --------------------------------------------------------------------------- PipeDream-2BW


class WeightVersions:
    """PipeDream-2BW's double-buffered weights (arXiv 2006.09503, section 3.2).

    During step t two versions exist: `stale` = W(t-1), read by every pass of batch t, and `newest` =
    W(t), the parameters' storage at the start of the step, read by batch t+1's early forwards. `use`
    points the parameters at one of them (a storage swap, no copy). At the end of the step `end_run`
    copies W(t) into the buffer that held W(t-1) (free now) and leaves the parameters on the buffer the
    optimizer will turn into W(t+1):

    - no next-batch work in flight (a drained step): the parameters keep their own storage (ZeRO keeps
      them as views of its flat buffers), which becomes W(t+1); the copy is the new stale version;
    - next-batch forwards in flight: their autograd graphs hold W(t)'s storage, so that one becomes the
      stale version and the copy is what the optimizer updates. The optimizer's in-place update bumps the
      parameters' autograd version counters although the saved storage did not change; `begin_run` sets
      the counters back to their values when the graphs saved them.

    One copy per step; W(0) = W(1) on the first step.
    """

    def __init__(self, params: list[nn.Parameter]):
        self.params = params
        self.stale: list[torch.Tensor] | None = None  # W(t-1)
        self.newest: list[torch.Tensor] | None = None  # W(t), during a step
        self.current: list[torch.Tensor] | None = None  # the version the parameters point at
        self.in_flight = False  # next-batch graphs from the last step hold `stale`
        self._counters: list[int] = []

    @torch.no_grad()
    def begin_run(self) -> None:
        if self.stale is None:
            self.stale = [p.detach().clone() for p in self.params]
        self.newest = [p.data for p in self.params]
        self.current = self.newest
        if self.in_flight:
            torch._C._autograd._unsafe_set_version_counter(tuple(self.params), tuple(self._counters))

    def use(self, batch: int) -> None:
        """Point the parameters at the version batch 0 (this step's) or 1 (the next step's) reads."""
        bufs = self.stale if batch == 0 else self.newest
        if bufs is not self.current:
            for p, b in zip(self.params, bufs):
                p.data = b
            self.current = bufs

    @torch.no_grad()
    def end_run(self, in_flight: bool) -> None:
        assert self.stale is not None and self.newest is not None
        for i, p in enumerate(self.params):
            free = self.stale[i]
            free.copy_(self.newest[i])
            if in_flight:
                p.data, self.stale[i] = free, self.newest[i]
            else:
                p.data = self.newest[i]
        self.newest = self.current = None
        self.in_flight = in_flight
        self._counters = [p._version for p in self.params] if in_flight else []

    def state_dict(self) -> list[torch.Tensor]:
        """The stale version W(t) after step t (empty before the first step): needed for an exact resume.

        Only at a drained step boundary: the next batch's early forwards are not part of the state.
        """
        if self.in_flight:
            raise RuntimeError("2BW weight versions saved while the next batch is in flight; drain first")
        return list(self.stale or [])

    @torch.no_grad()
    def load_state_dict(self, stale: list[torch.Tensor]) -> None:
        self.stale = [t.to(p.device, p.dtype).clone() for t, p in zip(stale, self.params)] if stale else None
        self.in_flight = False
