"""``strategy.impl=manual``: the pipeline loop with our own isend/recv, one order per rank from
``schedules.py`` (gpipe, 1f1b, interleaved_1f1b, zero_bubble), any number of chunks per rank.
zero_bubble's orders split each backward into B and W (pp/zero_bubble.py runs the split).

Global chunk g lives on pipeline rank g % p (the strategy's ``rank_of``: with tp the pipeline's
ranks are tp apart, each sending to the same tp coordinate of the next stage); its input comes from
chunk g - 1, its output goes to chunk g + 1 (with v > 1 the last rank sends back to the first).
Tags: the forward tensor entering chunk g for micro-batch i is ``g m + i``, the gradient
leaving it ``BACKWARD_TAG + g m + i``.

Dropout (models/dropout.py): a sample's masks are keyed by its pixels, which only the ``embed``
layer sees. Every rank of a pipeline reads the pipeline's whole batch (the last needs the targets),
so a rank without the first chunk keys each micro-batch from its own copy of the pixels, once per
micro-batch as single's ``embed`` does (the same occurrence counts), and every chunk after the
first runs with its micro-batch's keys."""

from __future__ import annotations

import contextlib
import time

import torch
import torch.distributed as dist

from parallel_lab.comm.counter import trace_label
from parallel_lab.models.dropout import SampleDropout
from parallel_lab.protocol import IDLE_LABEL
from parallel_lab.strategies.pp import handoffs
from parallel_lab.strategies.pp.schedules import SPLIT_BACKWARD
from parallel_lab.strategies.pp.zb_orders import run_orders
from parallel_lab.strategies.pp.zero_bubble import DeferredWeights
from parallel_lab.strategies.precision import as_compute

BACKWARD_TAG = 1 << 20


class ManualLoop:
    """Runs one rank's order; ``pipe`` is the strategy (its chunks, group, options and timers)."""

    def __init__(self, pipe) -> None:
        self.pipe = pipe
        o = pipe.opts
        self.m, self.p, self.n = o.microbatches, o.stages, o.stages * o.virtual_stages
        self.order = run_orders(o)[pipe.stage]  # zero bubble with measured passes: built from them
        self.keys = next((mod.keys for mod in pipe.model.modules() if isinstance(mod, SampleDropout)), None)
        self.max_inflight = 0
        self.late = 0  # receives posted only as their own op began (none: all at the step's start)
        split = str(o.schedule) in SPLIT_BACKWARD
        self.deferred = DeferredWeights(pipe.model, pipe.saved.pack) if split else None
        # Per train_step, the first handoffs.RECORDED_STEPS after the warm-up kept (bounded records):
        # (op, global chunk) -> the compute of each run of it; and the step's start, its end (the
        # strategy's flush) and each op's marks on the host's monotonic clock (pp/handoffs.py: the
        # hand-offs' cost, what the replay adds to the compute)
        skip = pipe.cfg.trainer.warmup_steps * pipe.cfg.trainer.grad_accum
        self.op_seconds, self.timeline = handoffs.StepRecord(skip), handoffs.StepRecord(skip)
        self.marks: dict[str, float] = {}  # the running op's (handoffs.MARKS)

    def rank_of(self, g: int) -> int:
        return self.pipe.rank_of(g)  # the pipeline's global ranks (tp apart under dp x pp x tp)

    def step(self, inputs: torch.Tensor, targets: torch.Tensor, num_micro: int) -> None:
        pipe = self.pipe
        record = self.timeline.start(start=time.perf_counter(), ops=[])  # this step's marks
        # Micro-batches in storages of their own: what a stage holds for backward is its micro-batch,
        # not a view keeping the whole batch (the activations the planner counts).
        self.xs, self.ys = [c.clone() for c in inputs.chunk(self.m)], targets.chunk(self.m)
        self.num_micro, self.pending, self.local, self.micro_keys, self.posted = num_micro, [], {}, {}, {}
        stash: dict = {}
        self.op_seconds.start()
        # Every receive of the step is posted before its first op: gloo moves nothing until the
        # receiver asks (a rendezvous), and a tensor whose receive is already posted leaves inside
        # the sender's isend and arrives while this rank computes. Posted one op ahead instead,
        # posts and sends met a transfer in flight on the same pair, carried by gloo's own thread:
        # on shared cores such a call now and then waited a scheduler's time slice, 10-12 ms per op
        # on average in interleaved 1F1B against 2-5 ms posted at once (docs/pp.md). The cost: the
        # step's receive buffers (one boundary tensor per micro-batch, chunk and direction) exist
        # from its start; what autograd holds (the activation plan) is unchanged.
        for k in range(len(self.order)):
            self.post(k)
        for k, (op, c, i) in enumerate(self.order):
            self.marks = {"begin": time.perf_counter()}
            self.post(k, late=True)  # posted above: counts none (pp_recvs_posted_late)
            self.marks["posted"] = time.perf_counter()
            g = pipe.chunk_ids[c]
            if op == "F":
                stash[(c, i)] = self.forward(c, g, i)
                self.max_inflight = max(self.max_inflight, len(stash))
            elif op == "B":
                self.backward(g, i, *stash.pop((c, i)))
            else:
                self.weights(g, i)
            self.marks["end"] = time.perf_counter()
            record["ops"].append((op, g, i, *(self.marks.get(k) for k in handoffs.MARKS)))
        # gloo completes a send when the neighbour has received it: waiting here is waiting for
        # the neighbour to get to its recv, idle like a recv (worker/timeline.py).
        with trace_label(f"{IDLE_LABEL}send"):
            for work, _ in self.pending:
                work.wait()
        self.pending = []
        record["drained"] = time.perf_counter()

    # ----- point to point (a chunk whose neighbour is on this rank hands over in memory) -----
    def post(self, k: int, late: bool = False) -> None:
        """Post the receive op k of the order needs (nothing if none, already posted, or local);
        ``late``: posted only as op k begins (counted: ``pp_recvs_posted_late``)."""
        if k >= len(self.order):
            return
        op, c, i = self.order[k]
        g = self.pipe.chunk_ids[c]
        if op == "F" and g > 0:
            g_from, tag, boundary = g - 1, g * self.m + i, g
        elif op == "B" and g < self.n - 1:  # d(loss)/d(output): shaped as chunk g + 1's input
            g_from, tag, boundary = g + 1, BACKWARD_TAG + g * self.m + i, g + 1
        else:
            return
        if tag in self.posted or self.rank_of(g_from) == self.pipe.env.rank:
            return
        self.late += late
        start = time.perf_counter()
        shape = self.pipe.chunk_input_shape(boundary, self.xs[i])
        buf = torch.empty(shape, dtype=self.pipe.compute_dtype, device=self.pipe.device)  # bf16: sent in bf16
        self.posted[tag] = dist.irecv(buf, src=self.rank_of(g_from), tag=tag, group=self.pipe.group), buf
        self.pipe.recv_wait += time.perf_counter() - start

    def recv(self, shape: torch.Size, g_from: int, tag: int) -> torch.Tensor:
        if self.rank_of(g_from) == self.pipe.env.rank:
            return self.local.pop(tag)
        work, buf = self.posted.pop(tag)
        assert buf.shape == shape, (tag, buf.shape, shape)
        start = time.perf_counter()
        # The stage cannot compute until its neighbour's tensor arrives: the trace counts this as
        # idle (the pipeline bubble), not as communication (worker/timeline.py).
        self.marks["wait"] = time.perf_counter()
        with trace_label(f"{IDLE_LABEL}recv"):
            work.wait()
        self.marks["got"] = time.perf_counter()
        self.pipe.recv_wait += time.perf_counter() - start
        return buf

    def send(self, tensor: torch.Tensor, g_to: int, tag: int) -> None:
        if self.rank_of(g_to) == self.pipe.env.rank:
            self.local[tag] = tensor.detach().clone()
            return
        # Non-blocking: a stage never waits for its neighbour to take the data, so two stages
        # sending to each other at once (1F1B's steady state) cannot deadlock. The call is not free:
        # gloo writes what the socket takes at once in this thread (a hand-off cost the bubble
        # formula does not have; pp_send_s).
        start = time.perf_counter()
        work = dist.isend(tensor.contiguous(), dst=self.rank_of(g_to), tag=tag, group=self.pipe.group)
        self.pipe.send_time += time.perf_counter() - start
        self.pending.append((work, tensor))

    # ----- dropout's per-sample keys -----
    def use_keys(self, g: int, i: int) -> None:
        if self.keys is None or g == 0:
            return  # chunk 0's embed keys the micro-batch itself
        if i not in self.micro_keys:  # a rank without chunk 0: key the micro-batch from its pixels
            self.keys.set(as_compute(self.xs[i], self.pipe.compute_dtype))  # as chunk 0's embed sees them
            self.micro_keys[i] = self.keys.keys
        self.keys.keys = self.micro_keys[i]

    # ----- one op -----
    def forward(self, c: int, g: int, i: int):
        pipe, m = self.pipe, self.m
        if g == 0:
            x = self.xs[i]
        else:
            shape = pipe.chunk_input_shape(g, self.xs[i])
            x = self.recv(shape, g - 1, tag=g * m + i).requires_grad_()
        self.use_keys(g, i)
        start = time.perf_counter()
        if pipe.aux is not None:
            pipe.aux.clear()  # what this chunk's MoE layers record now is this micro-batch's, theirs alone
        out = pipe.run_chunk(c, x)  # bf16: on copies of the weights, logits in fp32
        if g == 0 and self.keys is not None:
            self.micro_keys[i] = self.keys.keys  # what the embed set, for this rank's later chunks
        aux = None
        if g == self.n - 1:
            out = pipe.loss_fn(out, self.ys[i])  # + the last chunk's load-balancing losses
            pipe.losses.append(out.detach())
        elif pipe.aux is not None and (aux := pipe.aux.total()) is not None:
            pipe.aux_losses.append(aux.detach())  # an earlier chunk's: its own backward adds it (below)
        self.timed("F", g, start)
        if g < self.n - 1:
            self.send(out.detach(), g + 1, tag=(g + 1) * m + i)
        return x, out, aux

    def timed(self, op: str, g: int, start: float) -> None:
        """Count the op's compute since ``start`` as busy, and keep it per (op, chunk): the replay
        of the step from measured compute (schedules.play, bench bubbles) reads them."""
        self.marks["compute"], self.marks["computed"] = start, time.perf_counter()
        seconds = self.marks["computed"] - start
        self.pipe.busy.seconds += seconds
        self.op_seconds.current.setdefault((op, g), []).append(seconds)

    def backward(self, g: int, i: int, x: torch.Tensor, out: torch.Tensor, aux: torch.Tensor | None) -> None:
        """Micro-batch i's backward through chunk g. ``aux``: the load-balancing losses of the
        chunk's MoE layers (not the last chunk's, which its loss holds): one more root of the same
        backward, scaled as the loss is, so every stage's routers get single's gradient."""
        tag = BACKWARD_TAG + g * self.m + i
        # zero bubble: this is B, the weight-gradient GEMMs wait for W (weights)
        split = self.deferred.pass_of((g, i)) if self.deferred else contextlib.nullcontext()
        if g == self.n - 1:
            # out is micro-batch i's mean loss: scale so the summed gradient is the global mean's.
            start = time.perf_counter()
            with split:
                (out / (self.m * self.num_micro)).backward()
        else:
            grad = self.recv(out.shape, g + 1, tag=tag)
            start = time.perf_counter()
            with split:
                if aux is None:
                    out.backward(grad)
                else:
                    torch.autograd.backward((out, aux / (self.m * self.num_micro)), (grad, None))
        self.timed("B", g, start)
        if g > 0:
            self.send(x.grad, g - 1, tag=tag - self.m)

    def weights(self, g: int, i: int) -> None:
        """Zero bubble's W: the weight gradients micro-batch i's B left for later (nothing to send)."""
        start = time.perf_counter()
        self.deferred.run((g, i))
        self.timed("W", g, start)
