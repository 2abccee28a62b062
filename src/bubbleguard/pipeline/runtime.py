"""The pipeline runtime: executes a stage's action list over torch.distributed point-to-point.

Every rank builds a :class:`PipelineJob` for its stage and calls :meth:`PipelineJob.step` once per
iteration with the same arguments (its replica's batch); each rank uses what its stage needs (the
first stage the inputs, the last stage the targets). Receives are posted non-blocking and waited on
where the schedule needs the data; while a stage waits, optional :class:`StepHooks` (a
checkpointer) copy snapshot chunks in the window, and the wait is recorded as an idle event on the
timeline, with the copies inside it.

Call order, per rank::

    job = PipelineJob(stage, optimizer, loss_fn, layout=Layout(P, D), schedule="1f1b",
                      num_microbatches=M)          # all ranks; creates the replica groups
    for step in ...:
        loss = job.step(inputs, targets)           # all ranks; returns the loss on last stages

Gradients of data-parallel replicas of a stage are averaged with one all-reduce before the optimizer
step; the last stage's loss rides along in the same buffer, so reporting it costs no extra
collective.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from collections.abc import Callable
from typing import Protocol

import torch
import torch.distributed as dist

from bubbleguard import yielding
from bubbleguard.pipeline.layout import Layout
from bubbleguard.pipeline.schedules import (
    Action,
    ActionKind,
    PipelineSchedule,
    build_schedule,
    validate,
    with_checkpoint,
)
from bubbleguard.pipeline.stage import StageModule
from bubbleguard.pipeline.timeline import EventKind, Timeline

__all__ = ["PipelineJob", "StepHooks"]

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

# Shapes are negotiated once with a fixed-size header: dtype code, ndim, up to 8 dims.
_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32]
_HEADER_LEN = 10


class StepHooks(Protocol):
    """What a checkpointer plugs into the runtime; called by one thread at a time.

    Per iteration: at every receive ``has_work``, and if it says so ``run_one`` any number of
    times while the stage waits (from a helper thread, while the training thread blocks in the
    receive), then ``before_step`` at the ``CHECKPOINT`` action (just before
    the optimizer step: the state must not change under an unfinished snapshot), then
    ``after_step`` right after the optimizer step. Time spent in ``before_step`` and
    ``after_step`` is checkpoint overhead (``ckpt_blocking_s``); time in ``run_one`` hides in
    bubbles (``ckpt_bubble_s``), except for the part of a unit that outlasts its wait: from the
    data's arrival until the unit in flight ends, the stage sits idle (``ckpt_overrun_s``).
    """

    def has_work(self) -> bool:
        """Whether ``run_one`` has anything to do now (cheap; asked before every receive).

        False lets the runtime wait on the receive without waking the helper thread that runs
        ``run_one`` during waits (see ``_BubbleWorker``).
        """
        ...

    def run_one(self) -> bool:
        """Do one short unit of work (copy a chunk); return False when there is nothing to do."""
        ...

    def before_step(self) -> None:
        """Finish the snapshot in flight (copy what the bubbles did not)."""
        ...

    def after_step(self, step: int) -> None:
        """The optimizer just produced the state of ``step``: start its snapshot if due."""
        ...


_HANDOFF_S = 50e-6
"""On the CPU, how long the bubble thread sleeps when woken for a wait, before its first unit:
time for the training thread, which it would otherwise preempt, to enter the receive."""

_DEVICE_POLL_S = 0.0005
"""How often the helper thread looks again for a device copy that has landed (GPU)."""


class _BubbleWorker:
    """Runs ``hooks.run_one`` in a helper thread while the training thread waits on a receive.

    Gloo's ``Work.is_completed()`` does not turn true for a receive until someone calls ``wait()``,
    so the thread that waits cannot also learn "the data is here" between copies. The training
    thread therefore waits itself (``wait()`` releases the GIL and returns the moment the data
    lands) while this thread copies chunks (the copies release the GIL too). After the wait,
    :meth:`pause` lets the chunk in flight finish, so a copy never overlaps compute and at most one
    chunk overruns a wait, as before. Hooks are only ever called by one thread at a time: this one
    between :meth:`resume` and :meth:`pause`, the training thread otherwise.

    On the CPU this thread's native copies yield the core between 256 KiB pieces while the
    training thread waits (:mod:`bubbleguard.yielding`), so that the training thread, woken
    when the data lands, need not queue behind a copy until the scheduler's next tick;
    :meth:`pause` turns the yielding off, and the rest of the chunk runs straight through.
    Where the process may restore a thread's priority, the native copies instead run at
    ``SCHED_IDLE`` while the training thread waits (the thread's Python code, which holds the
    GIL, never does) and only enter the kernel between pieces (see :mod:`bubbleguard.yielding`);
    :meth:`pause` puts the thread back to normal before waiting for the chunk in flight: a
    thread left at ``SCHED_IDLE`` was starved by other busy processes while the training thread
    waited for it (mean step +42% beside two of them, measured Dec 5).

    On a GPU the work is the snapshot's device copies, which run on the copy engine, and their
    checksums, on a CPU core the training thread (which only launches kernels) leaves free: the
    job runs this thread alongside compute, and when ``run_one`` has nothing to do *yet* while
    ``has_work`` says there is more (a copy still in flight), the thread looks again every
    :data:`_DEVICE_POLL_S` until :meth:`pause`, which interrupts the wait at once.
    """

    def __init__(self, device: torch.device) -> None:
        self._hooks: StepHooks | None = None
        self._device = device
        self._cond = threading.Condition()
        self._want = False  # written by the training thread: keep working
        self._busy = False  # cleared by this thread when it stopped
        self._closed = False
        self._spans: list[tuple[float, float]] = []
        self._error: BaseException | None = None
        # On the CPU, the helper copies at SCHED_IDLE during each wait where that can be undone.
        self._idle_in_waits = device.type == "cpu" and yielding.idle_priority_is_reversible()
        # Set while the training thread waits on a receive.
        self._yield = yielding.YieldFlag(yielding.ENTER_KERNEL if self._idle_in_waits
                                         else yielding.YIELD)
        self._thread = threading.Thread(target=self._loop, name="bubbleguard-bubble", daemon=True)
        self._thread.start()
        self._native_id = self._thread.native_id

    def _loop(self) -> None:
        if self._device.type == "cuda":
            torch.cuda.set_device(self._device)  # the current device is per thread
        else:
            yielding.install(self._yield)
        while True:
            with self._cond:
                while not self._busy and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
            assert self._hooks is not None
            poll = self._device.type == "cuda"
            if not poll:
                # Woken by resume(), this thread preempts the training thread on its way into
                # the receive, then holds the core for up to a tick in the wait's first unit
                # (a snapshot's capture, in Python, at normal priority): the receive then
                # starts late. Let the training thread reach its wait first (perf sched, 12 s
                # of `bubbleguard train` at the benchmark's size: the training threads spent
                # 40-54 ms preempted by this thread, mostly 1.6-3.2 ms once per step; 0-3 ms
                # with this sleep).
                time.sleep(_HANDOFF_S)
            try:
                while self._want:
                    t0 = time.perf_counter()
                    if self._hooks.run_one():
                        self._spans.append((t0, time.perf_counter()))
                    elif poll and self._hooks.has_work():
                        with self._cond:  # a device copy in flight: look again soon
                            self._cond.wait_for(lambda: not self._want, _DEVICE_POLL_S)
                    else:
                        break
            except BaseException as exc:  # handed to the training thread, which re-raises it
                self._error = exc
            with self._cond:
                self._busy = False
                self._cond.notify_all()

    def resume(self, hooks: StepHooks) -> None:
        """Start running ``hooks.run_one`` until :meth:`pause` (or until it has nothing to do)."""
        with self._cond:
            self._hooks = hooks
            self._want = self._busy = True
            self._yield.set(True)
            self._cond.notify_all()

    def pause(self) -> list[tuple[float, float]]:
        """Stop after the unit in flight; the (start, end) of every unit run since ``resume``.

        Raises:
            BaseException: whatever ``run_one`` raised.
        """
        self._yield.set(False)  # the training thread has the core: finish the chunk straight
        if self._idle_in_waits:  # and at normal priority: it must not starve while we wait
            yielding.restore_normal_priority(self._native_id)
        with self._cond:
            self._want = False
            self._cond.notify_all()  # ends a device poll's wait at once
            while self._busy:
                self._cond.wait()
        spans, self._spans = self._spans, []
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        return spans

    def close(self) -> None:
        with self._cond:
            self._want, self._closed = False, True
            self._cond.notify_all()
        self._thread.join()


class PipelineJob:
    """Runs one stage of a pipeline-parallel (optionally data-parallel) training job.

    Args:
        stage: this rank's :class:`StageModule` (see :func:`bubbleguard.pipeline.stage.split`).
        optimizer: optimizer over ``stage``'s parameters.
        loss_fn: ``loss_fn(output, target)`` giving the mean loss of one microbatch.
        layout: stages x replicas; defaults to ``Layout(stage.num_stages)``.
        schedule: ``"gpipe"``, ``"1f1b"`` or a prebuilt :class:`PipelineSchedule`.
        num_microbatches: microbatches per iteration (must divide the batch).
        timeline: record a timeline of every action (cheap; needed for bubble maps).
        hooks: a checkpointer's hooks (see :class:`StepHooks`), or None; can also be attached
            later with :meth:`attach_hooks`.

    Raises:
        ValueError: the layout does not match the process group or the stage.
        RuntimeError: a multi-rank layout without ``torch.distributed`` initialised.
    """

    def __init__(
        self,
        stage: StageModule,
        optimizer: torch.optim.Optimizer,
        loss_fn: LossFn,
        *,
        layout: Layout | None = None,
        schedule: str | PipelineSchedule = "1f1b",
        num_microbatches: int = 1,
        timeline: bool = True,
        hooks: StepHooks | None = None,
    ) -> None:
        self.layout = layout or Layout(stage.num_stages)
        if self.layout.num_stages != stage.num_stages:
            raise ValueError(f"layout has {self.layout.num_stages} stages but the stage module was "
                             f"split into {stage.num_stages}")
        if self.layout.world_size > 1 and not dist.is_initialized():
            raise RuntimeError(f"a layout of {self.layout.world_size} ranks needs "
                               "torch.distributed initialised (launch with torchrun)")
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        world = dist.get_world_size() if dist.is_initialized() else 1
        if world != self.layout.world_size:
            raise ValueError(f"layout {self.layout.num_stages} stages x "
                             f"{self.layout.num_replicas} replicas needs {self.layout.world_size} "
                             f"ranks, the process group has {world}")
        if self.layout.stage_of(self.rank) != stage.stage_index:
            raise ValueError(f"rank {self.rank} holds stage {self.layout.stage_of(self.rank)} in the "
                             f"layout but was given stage {stage.stage_index}")
        self.stage = stage
        # Receive buffers live where the stage's parameters do (CPU with gloo, GPU with NCCL).
        first_param = next(stage.parameters(), None)
        self.device = first_param.device if first_param is not None else torch.device("cpu")
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.schedule = (schedule if isinstance(schedule, PipelineSchedule)
                         else build_schedule(schedule, stage.num_stages, num_microbatches))
        validate(self.schedule)
        self._plain_schedule = self.schedule  # without CHECKPOINT actions (see detach_hooks)
        self.num_microbatches = self.schedule.num_microbatches
        self.actions: tuple[Action, ...] = self.schedule.stages[stage.stage_index]
        self.replica = self.layout.replica_of(self.rank)
        self.timeline = Timeline(self.rank, stage.stage_index, self.replica, enabled=timeline)
        self.hooks: StepHooks | None = None
        if hooks is not None:
            self.attach_hooks(hooks)
        self.step_count = 0
        self.last_stats: dict[str, float] = {}
        # Every rank must create every group, in the same order.
        self._replica_group: dist.ProcessGroup | None = None
        if self.layout.num_replicas > 1:
            for s in range(self.layout.num_stages):
                group = dist.new_group(self.layout.replica_ranks(s))
                if s == stage.stage_index:
                    self._replica_group = group
        self._input_meta: tuple[torch.Size, torch.dtype] | None = None
        self._output_meta: tuple[torch.Size, torch.dtype] | None = None
        self._worker: _BubbleWorker | None = None
        self._alongside = False  # the worker runs alongside compute (GPU; see _start_alongside)

    def attach_hooks(self, hooks: StepHooks) -> None:
        """Plug a checkpointer in: adds the ``CHECKPOINT`` action before every ``STEP``.

        Replaces hooks attached before (one checkpointer drives a job at a time).
        """
        self.hooks = hooks
        self.schedule = with_checkpoint(self._plain_schedule)
        self.actions = self.schedule.stages[self.stage.stage_index]

    def detach_hooks(self) -> None:
        """Unplug the checkpointer: the next steps run the schedule without checkpoint work.

        Call it between steps, after the checkpointer's ``flush()`` (a snapshot in flight
        would otherwise never finish). ``attach_hooks`` plugs it (or another) back in.
        """
        self.hooks = None
        self.schedule = self._plain_schedule
        self.actions = self.schedule.stages[self.stage.stage_index]

    # ----------------------------------------------------------------- helpers

    def _peer_rank(self, peer_stage: int) -> int:
        return self.layout.rank(peer_stage, self.replica)

    @staticmethod
    def _tag(action: Action) -> int:
        assert action.microbatch is not None
        is_grad = action.kind in (ActionKind.SEND_GRAD, ActionKind.RECV_GRAD)
        return 2 * action.microbatch + int(is_grad)

    def _start_alongside(self) -> None:
        """On a GPU, run the hooks' work in the helper thread alongside compute.

        The snapshot's copies run on the copy engine and the training thread only launches
        kernels, so there is no reason to keep the work to the waits as on the CPU. It runs
        from the start of ``step()`` to the ``CHECKPOINT`` action and from ``after_step`` to
        the end of ``step()``; between ``step()`` calls the hooks are the caller's.
        """
        hooks = self.hooks
        if self.device.type != "cuda" or hooks is None or not hooks.has_work():
            return
        if self._worker is None:
            self._worker = _BubbleWorker(self.device)
        self._worker.resume(hooks)
        self._alongside = True

    def _stop_alongside(self, index: int) -> None:
        """Stop the work started by :meth:`_start_alongside` (the unit in flight finishes;
        waiting for it counts as ``ckpt_blocking_s``)."""
        if not self._alongside:
            return
        self._alongside = False
        assert self._worker is not None
        start = time.perf_counter()
        spans = self._worker.pause()
        end = time.perf_counter()
        self.timeline.add(EventKind.CHECKPOINT, "CKPT pause", start, end, index)
        self.last_stats["ckpt_blocking_s"] += end - start
        for t0, t1 in spans:
            self.timeline.add(EventKind.CHECKPOINT, "ckpt chunk", t0, t1, index)
            self.last_stats["ckpt_bubble_s"] += t1 - t0

    def _wait_recv(self, work: dist.Work, action: Action, index: int) -> None:
        start = time.perf_counter()
        hooks = self.hooks
        if self._alongside or hooks is None or not hooks.has_work():
            work.wait()
        else:
            if self._worker is None:
                self._worker = _BubbleWorker(self.device)
            self._worker.resume(hooks)
            try:
                work.wait()
            finally:
                arrived = time.perf_counter()
                spans = self._worker.pause()
                self.last_stats["ckpt_overrun_s"] += time.perf_counter() - arrived
            for t0, t1 in spans:
                self.timeline.add(EventKind.CHECKPOINT, "ckpt chunk", t0, t1, index)
                self.last_stats["ckpt_bubble_s"] += t1 - t0
        self.timeline.add(EventKind.IDLE, f"wait {action}", start, time.perf_counter(), index)

    def _negotiate_shapes(self, first_microbatch: torch.Tensor | None) -> None:
        """Learn the activation shapes at both ends of this stage, stage by stage.

        The first stage runs one microbatch through a no-grad forward and tells the next stage what
        it produced; each stage does the same with a zero input of the announced shape. RNG state is
        restored afterwards so that the real first step sees the same random numbers.
        """
        if self.stage.is_first:
            assert first_microbatch is not None
            x = first_microbatch
        else:
            header = torch.zeros(_HEADER_LEN, dtype=torch.int64, device=self.device)
            dist.recv(header, self._peer_rank(self.stage.stage_index - 1))
            ndim = int(header[1])
            x = torch.zeros(tuple(int(d) for d in header[2:2 + ndim]), dtype=_DTYPES[int(header[0])],
                            device=self.device)
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            y = self.stage(x)
        self._input_meta = (x.shape, x.dtype)
        self._output_meta = (y.shape, y.dtype)
        if not self.stage.is_last:
            if y.dim() > _HEADER_LEN - 2 or y.dtype not in _DTYPES:
                raise ValueError(f"stage {self.stage.stage_index} output {tuple(y.shape)} "
                                 f"{y.dtype} cannot cross a stage boundary")
            header = torch.tensor([_DTYPES.index(y.dtype), y.dim(), *y.shape]
                                  + [0] * (_HEADER_LEN - 2 - y.dim()), dtype=torch.int64,
                                  device=self.device)
            dist.send(header, self._peer_rank(self.stage.stage_index + 1))

    def _microbatches(self, batch: torch.Tensor | None, what: str) -> list[torch.Tensor] | None:
        if batch is None:
            return None
        m = self.num_microbatches
        if batch.shape[0] % m:
            raise ValueError(f"{what} batch of {batch.shape[0]} rows does not split into "
                             f"{m} microbatches; use a batch size divisible by {m}")
        return list(batch.chunk(m))

    # -------------------------------------------------------------------- step

    def step(self, inputs: torch.Tensor | None, targets: torch.Tensor | None) -> float | None:
        """Run one training iteration (forward, backward, gradient averaging, optimizer step).

        Args:
            inputs: this replica's input batch (needed on the first stage; ignored elsewhere).
            targets: this replica's targets (needed on the last stage; ignored elsewhere).

        Returns:
            On last stages, the iteration's mean loss over all replicas' batches; None elsewhere.

        Raises:
            ValueError: a missing or indivisible batch on a stage that needs it.
        """
        stage = self.stage
        if stage.is_first and inputs is None:
            raise ValueError("the first stage needs the inputs batch")
        if stage.is_last and targets is None:
            raise ValueError("the last stage needs the targets batch")
        in_mbs = self._microbatches(inputs, "inputs") if stage.is_first else None
        tgt_mbs = self._microbatches(targets, "targets") if stage.is_last else None
        if self._input_meta is None:
            self._negotiate_shapes(in_mbs[0] if in_mbs else None)
        assert self._input_meta is not None and self._output_meta is not None
        self.step_count += 1
        self.timeline.step = self.step_count
        self.last_stats = {"ckpt_blocking_s": 0.0, "ckpt_bubble_s": 0.0, "ckpt_overrun_s": 0.0}
        stage_inputs: dict[int, torch.Tensor] = {}
        stage_outputs: dict[int, torch.Tensor] = {}
        losses: dict[int, torch.Tensor] = {}
        received: dict[tuple[ActionKind, int], torch.Tensor] = {}
        pending_sends: list[tuple[dist.Work, torch.Tensor]] = []
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        tl = self.timeline
        self._start_alongside()
        try:
            for index, action in enumerate(self.actions):
                kind, mb = action.kind, action.microbatch
                if kind is ActionKind.RECV_ACT or kind is ActionKind.RECV_GRAD:
                    assert mb is not None and action.peer is not None
                    shape, dtype = (self._input_meta if kind is ActionKind.RECV_ACT
                                    else self._output_meta)
                    buf = torch.empty(shape, dtype=dtype, device=self.device)
                    work = dist.irecv(buf, self._peer_rank(action.peer), tag=self._tag(action))
                    assert work is not None
                    self._wait_recv(work, action, index)
                    received[(kind, mb)] = buf
                elif kind is ActionKind.FORWARD:
                    assert mb is not None
                    with tl.span(EventKind.COMPUTE, str(action), index):
                        if stage.is_first:
                            assert in_mbs is not None
                            x = in_mbs[mb]
                        else:
                            x = received.pop((ActionKind.RECV_ACT, mb)).requires_grad_()
                        y = stage(x)
                        stage_inputs[mb] = x
                        if stage.is_last:
                            assert tgt_mbs is not None
                            losses[mb] = self.loss_fn(y, tgt_mbs[mb]) / self.num_microbatches
                            loss_sum += losses[mb].detach().double()
                        else:
                            stage_outputs[mb] = y
                elif kind is ActionKind.BACKWARD:
                    assert mb is not None
                    with tl.span(EventKind.COMPUTE, str(action), index):
                        if stage.is_last:
                            losses.pop(mb).backward()
                        else:
                            grad = received.pop((ActionKind.RECV_GRAD, mb))
                            torch.autograd.backward(stage_outputs.pop(mb), grad_tensors=grad)
                elif kind is ActionKind.SEND_ACT or kind is ActionKind.SEND_GRAD:
                    assert mb is not None and action.peer is not None
                    with tl.span(EventKind.SEND, str(action), index):
                        if kind is ActionKind.SEND_ACT:
                            payload = stage_outputs[mb].detach()
                        else:
                            grad_in = stage_inputs.pop(mb).grad
                            assert grad_in is not None, "stage input received no gradient"
                            payload = grad_in
                        work = dist.isend(payload, self._peer_rank(action.peer), tag=self._tag(action))
                        assert work is not None
                        pending_sends.append((work, payload))
                elif kind is ActionKind.CHECKPOINT:
                    assert self.hooks is not None
                    self._stop_alongside(index)
                    self._timed_hook(self.hooks.before_step, "CKPT finish", index)
                elif kind is ActionKind.STEP:
                    with tl.span(EventKind.STEP, "STEP", index):
                        for work, _ in pending_sends:
                            work.wait()
                        loss_sum = self._average_gradients(loss_sum)
                        self.optimizer.step()
                        self.optimizer.zero_grad(set_to_none=True)
                    if self.hooks is not None:
                        self._timed_hook(functools.partial(self.hooks.after_step, self.step_count),
                                         "CKPT begin", index)
                        self._start_alongside()
            loss = float(loss_sum) if stage.is_last else None
        except BaseException:
            # Leave no helper thread running into the caller's code; the error that stopped
            # the step is the one to report.
            if self._alongside:
                self._alongside = False
                with contextlib.suppress(Exception):
                    self._worker.pause()  # type: ignore[union-attr]
            raise
        self._stop_alongside(len(self.actions) - 1)
        return loss

    def _timed_hook(self, hook: Callable[[], None], name: str, index: int) -> None:
        start = time.perf_counter()
        hook()
        end = time.perf_counter()
        self.timeline.add(EventKind.CHECKPOINT, name, start, end, index)
        self.last_stats["ckpt_blocking_s"] += end - start

    def _average_gradients(self, loss_sum: torch.Tensor) -> torch.Tensor:
        """Average gradients (and the loss) over the stage's replicas with one all-reduce."""
        if self._replica_group is None:
            return loss_sum
        params = [p for p in self.stage.parameters() if p.requires_grad]
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                          for p in params] + [loss_sum.to(params[0]).reshape(1)])
        start = time.perf_counter()
        dist.all_reduce(flat, group=self._replica_group)
        self.timeline.add(EventKind.ALLREDUCE, "allreduce grads", start, time.perf_counter())
        flat /= self.layout.num_replicas
        offset = 0
        for p in params:
            n = p.numel()
            p.grad = flat[offset:offset + n].view_as(p).clone()
            offset += n
        return flat[offset].double()

    def close(self) -> None:
        """Stop the helper thread, if one was started. The process group stays as it is."""
        if self._worker is not None:
            self._worker.close()
            self._worker = None
